//! Buffers that live on another stream than the call's (`ops::StreamOrder`): the call waits for
//! their stream and their stream waits for the call, so a forward whose inputs were uploaded on
//! another stream, and whose output is read back there without a synchronisation of the call's
//! stream, gives bitwise the output of the same call on one stream; under CUDA graph capture such
//! buffers are refused before anything is captured.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardShape, ScalarDecayForward};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::{Family, InputSpec, Inputs, Regime, Shape};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{err, on_one_gpu, CheckResult};

const LIMIT: Duration = Duration::from_secs(120);

/// One forward's tensors, allocated and uploaded on `home`.
struct Tensors {
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    o: CudaSlice<bf16>,
}

impl Tensors {
    fn upload(home: &Arc<CudaStream>, inputs: &Inputs) -> std::result::Result<Self, String> {
        let bf = |t: &lasp_shmem::reference::Tensor| -> Vec<bf16> {
            t.data().iter().map(|&x| bf16::from_f64(x)).collect()
        };
        let g: Vec<f32> = inputs.g.data().iter().map(|&x| x as f32).collect();
        Ok(Tensors {
            q: home.clone_htod(&bf(&inputs.q)).map_err(err)?,
            k: home.clone_htod(&bf(&inputs.k)).map_err(err)?,
            v: home.clone_htod(&bf(&inputs.v)).map_err(err)?,
            g: home.clone_htod(&g).map_err(err)?,
            o: home
                .clone_htod(&vec![bf16::from_bits(0xFFFF); inputs.v.data().len()])
                .map_err(err)?,
        })
    }

    fn args(&mut self, shape: ForwardShape) -> ForwardArgs<'_> {
        ForwardArgs {
            shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: None,
            o: DeviceMut::new(&mut self.o),
            ht: None,
            scale: None,
        }
    }
}

fn bits(stream: &Arc<CudaStream>, o: &CudaSlice<bf16>) -> std::result::Result<Vec<u16>, String> {
    Ok(stream
        .clone_dtoh(o)
        .map_err(err)?
        .iter()
        .map(|x| x.to_bits())
        .collect())
}

fn check(fwd: &mut ScalarDecayForward, call: &Arc<CudaStream>) -> CheckResult {
    let spec = InputSpec {
        shape: Shape {
            b: 2,
            t: 4099,
            h: 3,
            dk: 128,
            dv: 128,
        },
        family: Family::ScalarDecay,
        regime: Regime::Mixed,
        seed: 41,
        round_to_bf16: true,
        initial_state: false,
    };
    let inputs = Inputs::generate(&spec).map_err(err)?;
    let shape = ForwardShape::from(spec.shape);

    // The reference bits: every buffer on the call's stream.
    let mut same = Tensors::upload(call, &inputs)?;
    fwd.launch(call, same.args(shape)).map_err(err)?;
    let want = bits(call, &same.o)?;

    // Uploaded on another stream, called on this one, read back on the other stream at once.
    let other = call.context().new_stream().map_err(err)?;
    let mut apart = Tensors::upload(&other, &inputs)?;
    fwd.launch(call, apart.args(shape)).map_err(err)?;
    let got = bits(&other, &apart.o)?;
    if got != want {
        let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
        return Err(format!(
            "{differ} of {} output elements differ when the buffers live on another stream",
            want.len()
        ));
    }
    // Dropped right after a call: freed on their stream only after the call's kernels.
    fwd.launch(call, apart.args(shape)).map_err(err)?;
    drop(apart);

    // Under capture: refused before anything is enqueued, and the capture still ends cleanly.
    let mut apart = Tensors::upload(&other, &inputs)?;
    other.synchronize().map_err(err)?;
    call.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(err)?;
    let refused = fwd.launch(call, apart.args(shape));
    let graph = call
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
        .map_err(err)?;
    drop(graph);
    call.synchronize().map_err(err)?;
    match refused {
        Err(e)
            if e.to_string()
                .contains("another stream than the one being captured") =>
        {
            Ok(format!(
                "bitwise equal across streams ({} elements); capture refused: {e}",
                want.len()
            ))
        }
        Err(e) => Err(format!("the capture was refused for another reason: {e}")),
        Ok(_) => Err("a call under capture with buffers of another stream was accepted".into()),
    }
}

#[test]
fn buffers_of_another_stream_are_ordered_and_refused_under_capture() {
    on_one_gpu(LIMIT, |rt, report| {
        let result = ScalarDecayForward::new(rt)
            .map_err(err)
            .and_then(|mut fwd| check(&mut fwd, rt.stream()));
        report.record("cross_stream_buffers", result, 0.0);
    });
}
