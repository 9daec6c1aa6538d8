//! Digests of every output of the scalar-decay operations on fixed inputs: the proof that a change
//! of the code keeps the bits. Run it from two builds and compare the files.
//!
//! ```text
//! lasp-run -n 4 target/release/digest --out /tmp/digests        # one JSON file per PE
//! ```
//!
//! Every PE runs the single-GPU forward and backward on the cases below (PE 0 records them), then
//! all PEs run the LASP-2 forward (saving each shard's start state) and backward at W = the PEs
//! launched, each PE recording its shard. A digest is FNV-1a (64 bit) over the raw little-endian
//! bits of a tensor, in memory order. Inputs come from a fixed-seed generator: q, k, v, dO uniform
//! in [-2, 2) rounded to bf16, gates uniform in (-rate, 0], h0 and dht uniform in [-1, 1).

use clap::Parser;
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use lasp_shmem::ops::scalar_decay::lasp2::{
    ExchangeMode, Lasp2Backward, Lasp2Forward, Lasp2Layout,
};
use lasp_shmem::ops::scalar_decay::{BackwardArgs, ScalarDecayBackward};
use lasp_shmem::ops::scalar_decay::{ForwardArgs, ForwardShape, ScalarDecayForward};
use lasp_shmem::ops::{bf16, DeviceMut, DeviceRef};
use lasp_shmem::reference::SplitMix64;
use lasp_shmem::{Config, Result, Runtime};
use lasp_shmem_examples::{export_nvshmem_env, shard_lengths, write_json};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Digests of every output of the scalar-decay operations on fixed inputs.
#[derive(Parser, Debug)]
#[command(name = "digest")]
struct Options {
    /// Folder for the per-PE files `digest.pe{N}.json`.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Skip the benchmark shapes (B=4 T=8K, B=1 T=32K, B=1 T=128K; H=16, D=128).
    #[arg(long)]
    small: bool,
}

/// FNV-1a over the bytes of `values` in memory order.
fn fnv1a<T: Copy>(values: &[T]) -> String {
    // SAFETY: the element types used here (bf16, f32) are plain bits without padding.
    let bytes = unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    };
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &byte in bytes {
        hash = (hash ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{hash:016x}")
}

/// One case: the shape (T is the whole sequence for LASP-2, cut into ragged shards) and the gate
/// rate (gates uniform in (-rate, 0]).
#[derive(Clone, Copy, Debug)]
struct Case {
    shape: ForwardShape,
    rate: f64,
}

impl Case {
    fn new(b: usize, t: usize, h: usize, dk: usize, dv: usize, rate: f64) -> Case {
        Case {
            shape: ForwardShape { b, t, h, dk, dv },
            rate,
        }
    }

    fn name(&self) -> String {
        let s = self.shape;
        format!(
            "B{}_T{}_H{}_Dk{}_Dv{}_r{}",
            s.b, s.t, s.h, s.dk, s.dv, self.rate
        )
    }
}

/// The test suite's kinds of shapes (ragged T, one and several segments, every (Dk, Dv), weak
/// and strong decay), then the benchmark shapes.
fn single_gpu_cases(small: bool) -> Vec<Case> {
    let mut cases = vec![
        Case::new(2, 257, 3, 64, 64, 0.1),
        Case::new(1, 1000, 2, 128, 128, 0.1),
        Case::new(2, 300, 2, 64, 128, 3.0),
        Case::new(1, 4097, 1, 128, 64, 0.01),
        Case::new(1, 20000, 1, 128, 128, 0.1),
        Case::new(3, 8191, 2, 64, 64, 1.0),
    ];
    if !small {
        cases.push(Case::new(4, 8192, 16, 128, 128, 0.1));
        cases.push(Case::new(1, 32768, 16, 128, 128, 0.1));
        cases.push(Case::new(1, 131072, 16, 128, 128, 0.1));
    }
    cases
}

/// LASP-2 cases: T is the shard length of every PE but the last, which is 37 tokens shorter.
fn lasp2_cases(small: bool) -> Vec<Case> {
    let mut cases = vec![
        Case::new(2, 203, 3, 64, 64, 0.1),
        Case::new(2, 203, 3, 128, 128, 1.0),
        Case::new(1, 9000, 2, 128, 128, 0.1),
    ];
    if !small {
        cases.push(Case::new(4, 8192, 16, 128, 128, 0.1));
    }
    cases
}

/// Fixed-seed host values.
struct Values(SplitMix64);

impl Values {
    fn uniform(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f64> {
        (0..n).map(|_| lo + (hi - lo) * self.0.uniform()).collect()
    }
    fn bf16s(&mut self, n: usize) -> Vec<bf16> {
        self.uniform(n, -2.0, 2.0)
            .into_iter()
            .map(bf16::from_f64)
            .collect()
    }
    fn f32s(&mut self, n: usize, lo: f64, hi: f64) -> Vec<f32> {
        self.uniform(n, lo, hi)
            .into_iter()
            .map(|x| x as f32)
            .collect()
    }
    fn gates(&mut self, n: usize, rate: f64) -> Vec<f32> {
        self.uniform(n, 0.0, rate)
            .into_iter()
            .map(|x| -(x as f32))
            .collect()
    }
}

/// The tensors of one forward-and-backward call.
struct Tensors {
    shape: ForwardShape,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    v: CudaSlice<bf16>,
    g: CudaSlice<f32>,
    h0: CudaSlice<f32>,
    d_o: CudaSlice<bf16>,
    d_ht: CudaSlice<f32>,
    o: CudaSlice<bf16>,
    ht: CudaSlice<f32>,
    start: CudaSlice<f32>,
    dq: CudaSlice<bf16>,
    dk: CudaSlice<bf16>,
    dv: CudaSlice<bf16>,
    dg: CudaSlice<f32>,
    dh0: CudaSlice<f32>,
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    n: usize,
) -> Result<CudaSlice<T>> {
    Ok(stream.alloc_zeros(n)?)
}

impl Tensors {
    /// Tokens `[start, start + shape.t)` of a sequence of `total` tokens drawn from `seed`:
    /// every PE draws the whole sequence and keeps its slice, so the W shards are one sequence.
    fn new(
        stream: &Arc<CudaStream>,
        case: &Case,
        seed: u64,
        (start, len, total): (usize, usize, usize),
    ) -> Result<Tensors> {
        let full = ForwardShape {
            t: total,
            ..case.shape
        };
        let shape = ForwardShape { t: len, ..full };
        let mut values = Values(SplitMix64::new(seed));
        // Per token row: [B, T, H, D] is b-major, so a shard is B slices of rows.
        let slice = |all: Vec<bf16>, width: usize| -> Vec<bf16> {
            let row = full.h * width;
            (0..full.b)
                .flat_map(|b| {
                    all[(b * total + start) * row..(b * total + start + len) * row].to_vec()
                })
                .collect()
        };
        let q = slice(values.bf16s(full.qk_len()), full.dk);
        let k = slice(values.bf16s(full.qk_len()), full.dk);
        let v = slice(values.bf16s(full.v_len()), full.dv);
        let d_o = slice(values.bf16s(full.v_len()), full.dv);
        let g_all = values.gates(full.gate_len(), case.rate);
        let g: Vec<f32> = (0..full.b)
            .flat_map(|b| {
                g_all[(b * total + start) * full.h..(b * total + start + len) * full.h].to_vec()
            })
            .collect();
        let h0 = values.f32s(full.state_len(), -1.0, 1.0);
        let d_ht = values.f32s(full.state_len(), -1.0, 1.0);
        Ok(Tensors {
            shape,
            q: stream.clone_htod(&q)?,
            k: stream.clone_htod(&k)?,
            v: stream.clone_htod(&v)?,
            g: stream.clone_htod(&g)?,
            h0: stream.clone_htod(&h0)?,
            d_o: stream.clone_htod(&d_o)?,
            d_ht: stream.clone_htod(&d_ht)?,
            o: zeros(stream, shape.v_len())?,
            ht: zeros(stream, shape.state_len())?,
            start: zeros(stream, shape.state_len())?,
            dq: zeros(stream, shape.qk_len())?,
            dk: zeros(stream, shape.qk_len())?,
            dv: zeros(stream, shape.v_len())?,
            dg: zeros(stream, shape.gate_len())?,
            dh0: zeros(stream, shape.state_len())?,
        })
    }

    fn forward_args(&mut self, h0: bool, ht: bool) -> ForwardArgs<'_> {
        ForwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: h0.then(|| DeviceRef::new(&self.h0)),
            o: DeviceMut::new(&mut self.o),
            ht: ht.then(|| DeviceMut::new(&mut self.ht)),
            scale: None,
        }
    }

    /// The backward's arguments; `h0` is the start state (LASP-2) or the forward's h0.
    fn backward_args(&mut self, h0_is_start: bool, d_ht: bool, dh0: bool) -> BackwardArgs<'_> {
        BackwardArgs {
            shape: self.shape,
            q: DeviceRef::new(&self.q),
            k: DeviceRef::new(&self.k),
            v: DeviceRef::new(&self.v),
            g: DeviceRef::new(&self.g),
            h0: Some(DeviceRef::new(if h0_is_start {
                &self.start
            } else {
                &self.h0
            })),
            d_o: DeviceRef::new(&self.d_o),
            d_ht: d_ht.then(|| DeviceRef::new(&self.d_ht)),
            dq: DeviceMut::new(&mut self.dq),
            dk: DeviceMut::new(&mut self.dk),
            dv: DeviceMut::new(&mut self.dv),
            dg: DeviceMut::new(&mut self.dg),
            dh0: dh0.then(|| DeviceMut::new(&mut self.dh0)),
            scale: None,
        }
    }

    /// Digests of the named outputs, under `prefix`.
    fn record(
        &self,
        stream: &Arc<CudaStream>,
        prefix: &str,
        names: &[&str],
        into: &mut BTreeMap<String, String>,
    ) -> Result<()> {
        for &name in names {
            let digest = match name {
                "o" => fnv1a(&stream.clone_dtoh(&self.o)?),
                "ht" => fnv1a(&stream.clone_dtoh(&self.ht)?),
                "start" => fnv1a(&stream.clone_dtoh(&self.start)?),
                "dq" => fnv1a(&stream.clone_dtoh(&self.dq)?),
                "dk" => fnv1a(&stream.clone_dtoh(&self.dk)?),
                "dv" => fnv1a(&stream.clone_dtoh(&self.dv)?),
                "dg" => fnv1a(&stream.clone_dtoh(&self.dg)?),
                "dh0" => fnv1a(&stream.clone_dtoh(&self.dh0)?),
                other => unreachable!("no output {other}"),
            };
            into.insert(format!("{prefix} {name}"), digest);
        }
        Ok(())
    }
}

fn single_gpu(rt: &Runtime, small: bool, digests: &mut BTreeMap<String, String>) -> Result<()> {
    let stream = rt.stream().clone();
    let mut forward = ScalarDecayForward::new(rt)?;
    let mut backward = ScalarDecayBackward::new(rt)?;
    for (i, case) in single_gpu_cases(small).iter().enumerate() {
        let t = case.shape.t;
        let mut x = Tensors::new(&stream, case, 100 + i as u64, (0, t, t))?;
        forward.launch(&stream, x.forward_args(true, true))?;
        backward.launch(&stream, x.backward_args(false, true, true))?;
        stream.synchronize()?;
        let prefix = format!("single {}", case.name());
        x.record(
            &stream,
            &prefix,
            &["o", "ht", "dq", "dk", "dv", "dg", "dh0"],
            digests,
        )?;
    }
    Ok(())
}

fn lasp2(rt: &Runtime, small: bool, digests: &mut BTreeMap<String, String>) -> Result<()> {
    let (me, npes) = (rt.pe(), rt.npes());
    let stream = rt.context().new_stream()?;
    let (first, last) = (me == 0, me + 1 == npes);
    for (i, case) in lasp2_cases(small).iter().enumerate() {
        let lengths = shard_lengths(npes, case.shape.t, 37.min(case.shape.t / 2));
        let start: usize = lengths[..me].iter().sum();
        let total: usize = lengths.iter().sum();
        let mut x = Tensors::new(&stream, case, 200 + i as u64, (start, lengths[me], total))?;
        let s = case.shape;
        let layout = Lasp2Layout {
            b: s.b,
            h: s.h,
            dk: s.dk,
            dv: s.dv,
        };
        let mut forward = Lasp2Forward::new(rt, layout, ExchangeMode::Overlapped)?;
        let mut backward = Lasp2Backward::new(rt, layout, ExchangeMode::Overlapped)?;
        let mut start_state = x.start.clone();
        forward.forward_saving(
            &stream,
            x.forward_args(true, last),
            Some(DeviceMut::new(&mut start_state)),
        )?;
        x.start = start_state;
        backward.backward(&stream, x.backward_args(true, last, first))?;
        forward.finish(&stream)?;
        backward.finish(&stream)?;
        let mut names = vec!["o", "start", "dq", "dk", "dv", "dg"];
        if last {
            names.push("ht");
        }
        if first {
            names.push("dh0");
        }
        x.record(
            &stream,
            &format!("lasp2 W{npes} PE{me} {}", case.name()),
            &names,
            digests,
        )?;
        forward.free()?;
        backward.free()?;
    }
    Ok(())
}

fn run(options: Options, config: Config) -> Result<()> {
    let rt = Runtime::init(config)?;
    let mut digests = BTreeMap::new();
    single_gpu(&rt, options.small, &mut digests)?;
    if rt.pe() != 0 {
        digests.clear();
    }
    lasp2(&rt, options.small, &mut digests)?;
    std::fs::create_dir_all(&options.out).map_err(|e| {
        lasp_shmem::Error::State(format!("cannot create {}: {e}", options.out.display()))
    })?;
    let path = options.out.join(format!("digest.pe{}.json", rt.pe()));
    write_json(&path, &digests)?;
    println!(
        "PE {}: {} digests in {}",
        rt.pe(),
        digests.len(),
        path.display()
    );
    rt.shutdown()
}

fn main() {
    let options = Options::parse();
    let prepared = Config::from_env().and_then(|config| {
        let config = Config {
            symmetric_heap_bytes: 1 << 30,
            ..config
        };
        // SAFETY: first thing in main: no thread has been started and no CUDA call made.
        unsafe { export_nvshmem_env(&config) }.map(|_| config)
    });
    if let Err(e) = prepared.and_then(|config| run(options, config)) {
        eprintln!("digest: {e}");
        lasp_shmem::runtime::exit_after_error(1);
    }
}
