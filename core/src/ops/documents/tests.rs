use super::*;

// Views of fake addresses for the argument checks: only measured, never launched.
fn offsets(addr: u64, len: usize) -> DocumentOffsets<'static> {
    // SAFETY: never launched; the checks read the address and the length only.
    DocumentOffsets::I64(unsafe { DeviceRef::from_raw(addr, len) })
}

fn docs(cu_seqlens: DocumentOffsets<'static>, shard_start: usize) -> Documents<'static> {
    Documents {
        cu_seqlens,
        shard_start,
    }
}

const SHAPE: GateShape = GateShape { b: 1, t: 256, h: 4 };

fn rejected(result: Result<impl Sized>, needle: &str) {
    match result {
        Err(Error::InvalidArgument(message)) => {
            assert!(message.contains(needle), "{message:?} lacks {needle:?}")
        }
        Err(other) => panic!("wrong error kind: {other}"),
        Ok(_) => panic!("accepted; expected an error naming {needle:?}"),
    }
}

#[test]
fn offsets_follow_fla_with_padding() {
    check_offsets(&[0, 1, 64, 65, 300], 300).unwrap();
    check_offsets(&[0, 300], 300).unwrap();
    check_offsets(&[0, 100, 300, 300, 300], 300).unwrap();
    rejected(check_offsets(&[1, 300], 300), "starts with");
    rejected(check_offsets(&[0, 200], 300), "ends with");
    rejected(check_offsets(&[0, 100, 100, 300], 300), "100 then 100");
    rejected(check_offsets(&[0, 100, 50, 300], 300), "100 then 50");
    rejected(check_offsets(&[0, 400, 300], 300), "400");
    rejected(check_offsets(&[0, 300, 5, 300], 300), "300 then 5");
}

#[test]
fn calls_are_checked_before_anything_is_enqueued() {
    let good = docs(offsets(0x1000, 5), 0);
    assert!(check("marks", &good, SHAPE).is_ok());
    rejected(
        check("marks", &docs(offsets(0x1000, 1), 0), SHAPE),
        "cu_seqlens has 1",
    );
    rejected(
        check("marks", &docs(offsets(0x1004, 5), 0), SHAPE),
        "8-byte aligned",
    );
    for shape in [
        GateShape { b: 0, ..SHAPE },
        GateShape { t: 0, ..SHAPE },
        GateShape { h: 0, ..SHAPE },
        GateShape {
            b: MAX_BATCH + 1,
            ..SHAPE
        },
    ] {
        rejected(check("marks", &good, shape), "at least 1");
    }
    let int32 = DocumentOffsets::I32(
        // SAFETY: as in `offsets`.
        unsafe { DeviceRef::from_raw(0x1004, 5) },
    );
    assert!(check("marks", &docs(int32, 7), SHAPE).is_ok());
}
