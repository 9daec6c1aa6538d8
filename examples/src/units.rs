//! Byte sizes as people write them on command lines (`32K`, `4M`, `1G`, binary units).

use lasp_shmem::{Error, Result};

/// Parses `123`, `32K`, `4M`, `1G` (also `KiB`/`MiB`/`GiB`) into bytes.
pub fn parse_bytes(text: &str) -> Result<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let shift = match unit.to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KIB" => 10,
        "M" | "MIB" => 20,
        "G" | "GIB" => 30,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "size {text:?}: use a number with K, M or G"
            )))
        }
    };
    let n: usize = digits.parse().map_err(|_| {
        Error::InvalidArgument(format!("size {text:?}: use a number with K, M or G"))
    })?;
    n.checked_shl(shift)
        .filter(|v| v >> shift == n)
        .ok_or_else(|| Error::InvalidArgument(format!("size {text:?} is too large")))
}

/// Formats bytes with the largest binary unit that divides them (`8MiB`, `32KiB`, `100B`).
pub fn format_bytes(bytes: usize) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// Parses a comma-separated list of sizes.
pub fn parse_byte_list(text: &str) -> Result<Vec<usize>> {
    text.split(',').map(parse_bytes).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_round_trip() {
        assert_eq!(
            parse_byte_list("32K,4M,1GiB,100").unwrap(),
            vec![32 << 10, 4 << 20, 1 << 30, 100]
        );
        assert_eq!(format_bytes(8 << 20), "8MiB");
        assert_eq!(format_bytes(1536), "1536B");
        assert!(parse_bytes("4X")
            .unwrap_err()
            .to_string()
            .contains("K, M or G"));
        assert!(parse_bytes("99999999999999999999G").is_err());
    }
}
