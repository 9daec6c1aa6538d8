//! The short convolution on LASP-2 shards (`ops::short_conv::ShortConv`) on every GPU under
//! `lasp-run`, forward and backward, with the halo exchanged from the device.
//!
//! ```text
//! lasp-run -n 4 short_conv                                  # the checks
//! lasp-run -n 4 short_conv --no-check --time 4x8192x2048 --json out.json
//! lasp-run -n 2 short_conv --no-check --silent-rank 0       # the fault drill: PE 1 names PE 0
//! ```
//!
//! Checks (every PE): the whole sequence from the f64 reference's generator (x and dy rounded
//! to bf16, the weight and bias to f32), cut into shards of unequal length, some shorter than
//! the halo (their successors' halos then span several PEs); this PE's y, dx, d_weight and
//! d_bias against `reference::short_conv::sharded` (relative error <= 5e-3; d_weight and d_bias
//! against this PE's own sums), its saved halo equal to the reference's halo bit for bit, a
//! repeated call and `--graph-calls` replays of one captured forward + backward bitwise equal
//! (the device epochs advanced once per replay); outputs poisoned before each call. Packed cases
//! (documents starting on, just before and just after every shard boundary, documents of one to
//! three tokens, shards shorter than the halo): against `reference::short_conv::packed_forward`
//! and `packed_backward` of the whole sequence (d_weight and d_bias: with dy zero outside this
//! PE's shard, its own sums). One line per
//! case and PE; exit status 1 when a check failed. Timing (`--time BxTxC`, T per GPU): each
//! direction's median over calls, the slowest PE's, with the bytes it moves per second.
//! `--silent-rank R`: PE R makes no call, and the PEs beside it must fail within the wait bound
//! naming it.

use clap::Parser;
use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::bf16;
use lasp_shmem::ops::documents::{DocumentOffsets, Documents};
use lasp_shmem::ops::short_conv::{
    Activation, ShortConv, ShortConvArgs, ShortConvGradArgs, ShortConvLayout,
};
use lasp_shmem::ops::{DeviceMut, DeviceRef};
use lasp_shmem::reference::short_conv::{self as reference, sharded};
use lasp_shmem::reference::{rel_err, SplitMix64, Tensor};
use lasp_shmem::{Config, Error, Result, Runtime};
use lasp_shmem_examples::{
    bf16_bits, bf16_values, bf16s, config_with_heap, f32_bits, f32_values, f32s,
    main_under_launcher, round, run_cases, shard_rows, write_json, NamedCase,
};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "short_conv")]
struct Options {
    /// Time these per-GPU shapes (BxTxC, T per GPU).
    #[arg(long = "time", value_name = "BxTxC", value_parser = parse_shape)]
    time: Vec<(usize, usize, usize)>,
    /// The timed convolution's kernel size.
    #[arg(long, default_value_t = 4)]
    kernel_size: usize,
    /// Time the convolution without its activation (SiLU otherwise).
    #[arg(long)]
    identity: bool,
    /// Skip the checks.
    #[arg(long)]
    no_check: bool,
    /// Graph replays of one captured forward + backward in each check.
    #[arg(long, default_value_t = 20)]
    graph_calls: u32,
    /// Write the timing rows here (PE 0).
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// This PE makes no call (the fault drill).
    #[arg(long, value_name = "PE")]
    silent_rank: Option<usize>,
}

fn parse_shape(text: &str) -> std::result::Result<(usize, usize, usize), String> {
    let dims: Vec<usize> = text
        .split('x')
        .map(|d| d.trim().parse().map_err(|_| format!("{text:?}: use BxTxC")))
        .collect::<std::result::Result<_, _>>()?;
    match dims[..] {
        [b, t, c] => Ok((b, t, c)),
        _ => Err(format!("{text:?}: use BxTxC")),
    }
}

const TOL: f64 = 5e-3;
const POISON_BF16: u16 = 0xFFFF;

/// One check: dimensions, the activation and bias, the shards' lengths (cycled over the PEs),
/// and packed documents or one sequence.
struct Case {
    b: usize,
    c: usize,
    k: usize,
    activation: Activation,
    bias: bool,
    lengths: Vec<usize>,
    /// fla's offsets of the documents over the whole sequence, or `None`.
    cu_seqlens: Option<Vec<usize>>,
}

impl NamedCase for Case {
    fn name(&self) -> String {
        format!(
            "short_conv_B{}_C{}_K{}_{:?}{}_shards{:?}{}",
            self.b,
            self.c,
            self.k,
            self.activation,
            if self.bias { "_bias" } else { "" },
            self.lengths,
            self.cu_seqlens
                .as_ref()
                .map_or(String::new(), |cu| format!("_{}docs", cu.len() - 1))
        )
    }
}

impl Case {
    fn layout(&self) -> ShortConvLayout {
        ShortConvLayout {
            batch: self.b,
            channels: self.c,
            kernel_size: self.k,
        }
    }
}

fn cases(npes: usize) -> Vec<Case> {
    let cycle =
        |pattern: &[usize]| -> Vec<usize> { pattern.iter().copied().cycle().take(npes).collect() };
    let case = |b, c, k, activation, bias, lengths: &[usize]| Case {
        b,
        c,
        k,
        activation,
        bias,
        lengths: cycle(lengths),
        cu_seqlens: None,
    };
    let packed = |case: Case| Case {
        cu_seqlens: Some(document_offsets(&case.lengths)),
        ..case
    };
    use Activation::*;
    vec![
        packed(case(2, 64, 4, Silu, true, &[100, 37, 200, 64])),
        packed(case(2, 64, 4, Identity, true, &[2, 1, 3, 40])),
        packed(case(3, 136, 3, Silu, false, &[1, 5, 1, 2])),
        case(2, 64, 4, Silu, true, &[100, 37, 200, 64]),
        // Two channel tiles of the convolution kernels.
        case(1, 2048, 4, Identity, false, &[300]),
        // Shards shorter than the halo: later halos span two and three PEs.
        case(2, 64, 4, Silu, true, &[2, 1, 3, 40]),
        case(3, 136, 3, Silu, true, &[1, 5, 1, 2]),
        case(2, 64, 2, Identity, false, &[17, 33, 65, 129]),
        // No halo at all.
        case(1, 64, 1, Identity, true, &[50, 20]),
        // Many token groups per sequence.
        case(2, 512, 4, Silu, true, &[2048, 1500, 4096, 3000]),
    ]
}

/// Documents over shards of these lengths: starting at tokens 1 and 3 (documents of one and two
/// tokens), 60, and two before, on and one after every shard boundary, the last one ending the
/// sequence.
fn document_offsets(lengths: &[usize]) -> Vec<usize> {
    let total: usize = lengths.iter().sum();
    let mut starts = vec![0, 1, 3, 60];
    let mut boundary = 0;
    for len in lengths {
        boundary += len;
        starts.extend([boundary.saturating_sub(2), boundary, boundary + 1]);
    }
    starts.retain(|&s| s < total);
    starts.sort_unstable();
    starts.dedup();
    starts.push(total);
    starts
}

/// One PE's inputs on the host.
struct HostShard<'a> {
    layout: ShortConvLayout,
    activation: Activation,
    tokens: usize,
    /// `[B, tokens, C]` rows.
    x: &'a [f64],
    dy: &'a [f64],
    weight: &'a [f64],
    bias: Option<&'a [f64]>,
    /// The documents' offsets over the whole sequence and this shard's first token in it.
    documents: Option<(&'a [usize], usize)>,
}

/// One PE's shard and outputs on the device.
struct Shard {
    layout: ShortConvLayout,
    tokens: usize,
    activation: Activation,
    x: CudaSlice<bf16>,
    weight: CudaSlice<f32>,
    bias: Option<CudaSlice<f32>>,
    dy: CudaSlice<bf16>,
    y: CudaSlice<bf16>,
    halo: CudaSlice<bf16>,
    dx: CudaSlice<bf16>,
    d_weight: CudaSlice<f32>,
    d_bias: Option<CudaSlice<f32>>,
    /// fla's offsets on the device and this shard's first token.
    documents: Option<(CudaSlice<i64>, usize)>,
}

/// The views of a shard's documents.
fn documents_of(documents: &Option<(CudaSlice<i64>, usize)>) -> Option<Documents<'_>> {
    documents.as_ref().map(|(cu, start)| Documents {
        cu_seqlens: DocumentOffsets::I64(DeviceRef::new(cu)),
        shard_start: *start,
    })
}

/// The bits one forward + backward left.
#[derive(PartialEq)]
struct Bits {
    y: Vec<u16>,
    halo: Vec<u16>,
    dx: Vec<u16>,
    d_weight: Vec<u32>,
    d_bias: Vec<u32>,
}

impl Shard {
    /// The host values of this PE's shard on the device.
    fn upload(stream: &Arc<CudaStream>, host: HostShard<'_>) -> Result<Self> {
        let HostShard {
            layout,
            activation,
            tokens,
            x,
            dy,
            weight,
            bias,
            documents,
        } = host;
        let documents = documents
            .map(|(cu, start)| -> Result<_> {
                let cu: Vec<i64> = cu.iter().map(|&o| o as i64).collect();
                Ok((stream.clone_htod(&cu)?, start))
            })
            .transpose()?;
        let activations = layout.batch * tokens * layout.channels;
        let bias = bias.map(|b| stream.clone_htod(&f32s(b))).transpose()?;
        Ok(Shard {
            layout,
            tokens,
            activation,
            x: stream.clone_htod(&bf16s(x))?,
            weight: stream.clone_htod(&f32s(weight))?,
            d_bias: bias
                .as_ref()
                .map(|_| stream.alloc_zeros(layout.channels))
                .transpose()?,
            bias,
            dy: stream.clone_htod(&bf16s(dy))?,
            y: stream.alloc_zeros(activations)?,
            halo: stream.alloc_zeros(layout.halo_len().max(1))?,
            dx: stream.alloc_zeros(activations)?,
            d_weight: stream.alloc_zeros(layout.channels * layout.kernel_size)?,
            documents,
        })
    }

    fn halo_len(&self) -> usize {
        self.layout.halo_len()
    }

    fn forward(&mut self, op: &mut ShortConv, stream: &Arc<CudaStream>) -> Result<()> {
        let halo_len = self.halo_len();
        let documents = documents_of(&self.documents);
        op.forward(
            stream,
            ShortConvArgs {
                tokens: self.tokens,
                x: DeviceRef::new(&self.x),
                weight: DeviceRef::new(&self.weight),
                bias: self.bias.as_ref().map(DeviceRef::new),
                activation: self.activation,
                y: DeviceMut::new(&mut self.y),
                saved_halo: (halo_len > 0).then(|| DeviceMut::new(&mut self.halo)),
                documents,
            },
        )
    }

    fn backward(&mut self, op: &mut ShortConv, stream: &Arc<CudaStream>) -> Result<()> {
        let halo_len = self.halo_len();
        let documents = documents_of(&self.documents);
        op.backward(
            stream,
            ShortConvGradArgs {
                tokens: self.tokens,
                x: DeviceRef::new(&self.x),
                halo: (halo_len > 0).then(|| DeviceRef::new(&self.halo)),
                weight: DeviceRef::new(&self.weight),
                bias: self.bias.as_ref().map(DeviceRef::new),
                activation: self.activation,
                dy: DeviceRef::new(&self.dy),
                dx: DeviceMut::new(&mut self.dx),
                d_weight: DeviceMut::new(&mut self.d_weight),
                d_bias: self.d_bias.as_mut().map(DeviceMut::new),
                documents,
            },
        )
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        let nan_bf16 = bf16::from_bits(POISON_BF16);
        for buffer in [&mut self.y, &mut self.halo, &mut self.dx] {
            let poison = vec![nan_bf16; buffer.len()];
            stream.memcpy_htod(&poison, buffer)?;
        }
        for buffer in [Some(&mut self.d_weight), self.d_bias.as_mut()]
            .into_iter()
            .flatten()
        {
            stream.memcpy_htod(&vec![f32::NAN; buffer.len()], buffer)?;
        }
        Ok(())
    }

    fn bits(&self, stream: &Arc<CudaStream>) -> Result<Bits> {
        Ok(Bits {
            y: bf16_bits(stream, &self.y)?,
            halo: bf16_bits(stream, &self.halo)?,
            dx: bf16_bits(stream, &self.dx)?,
            d_weight: f32_bits(stream, Some(&self.d_weight))?,
            d_bias: f32_bits(stream, self.d_bias.as_ref())?,
        })
    }

    /// One forward and backward on poisoned outputs; their bits.
    fn call(&mut self, op: &mut ShortConv, stream: &Arc<CudaStream>) -> Result<Bits> {
        self.poison(stream)?;
        self.forward(op, stream)?;
        self.backward(op, stream)?;
        op.finish(stream)?;
        self.bits(stream)
    }
}

fn random(shape: &[usize], scale: f64, rng: &mut SplitMix64) -> Tensor {
    let data = (0..shape.iter().product())
        .map(|_| rng.normal() * scale)
        .collect();
    Tensor::from_vec(shape, data).expect("the shape's length")
}

/// One case on this PE: Ok(detail) or Err(what failed).
fn check_case(
    rt: &Runtime,
    case: &Case,
    seed: u64,
    graph_calls: u32,
) -> Result<std::result::Result<String, String>> {
    let stream = rt.stream().clone();
    let me = rt.pe();
    let layout = case.layout();
    let total: usize = case.lengths.iter().sum();
    let start: usize = case.lengths[..me].iter().sum();
    let tokens = case.lengths[me];
    let mut rng = SplitMix64::new(seed);
    let x = random(&[case.b, total, case.c], 1.0, &mut rng).round_to_bf16();
    let dy = random(&[case.b, total, case.c], 1.0, &mut rng).round_to_bf16();
    let conv = reference::ShortConv {
        weight: random(&[case.c, case.k], 0.5, &mut rng).round_to_f32(),
        bias: case
            .bias
            .then(|| random(&[case.c], 0.2, &mut rng).round_to_f32()),
        activation: match case.activation {
            Activation::Identity => reference::Activation::Identity,
            Activation::Silu => reference::Activation::Silu,
        },
    };
    let fail = |e: lasp_shmem::reference::ReferenceError| Error::State(e.to_string());
    let want_fwd = sharded::forward(&conv, &x, &case.lengths).map_err(fail)?;
    let x_shard = x.slice_time(start, tokens);
    let dy_shard = dy.slice_time(start, tokens);
    // y and dx of the whole sequence, and this PE's own d_weight and d_bias.
    let (want_y, want_dx, local) = match &case.cu_seqlens {
        None => {
            let want_bwd = sharded::backward(&conv, &x, &case.lengths, &dy).map_err(fail)?;
            let halo = &want_fwd.halos[me];
            let (local, _) =
                reference::backward_with_halo(&conv, halo, &x_shard, &dy_shard).map_err(fail)?;
            (want_fwd.y.clone(), want_bwd.grads.dx, local)
        }
        Some(cu) => {
            let y = reference::packed_forward(&conv, &x, cu).map_err(fail)?;
            let dx = reference::packed_backward(&conv, &x, cu, &dy)
                .map_err(fail)?
                .dx;
            let mut mine = Tensor::zeros(dy.shape());
            let row = case.c;
            for b in 0..case.b {
                let at = (b * total + start) * row..(b * total + start + tokens) * row;
                mine.data_mut()[at.clone()].copy_from_slice(&dy.data()[at]);
            }
            let local = reference::packed_backward(&conv, &x, cu, &mine).map_err(fail)?;
            (y, dx, local)
        }
    };

    let mut shard = Shard::upload(
        &stream,
        HostShard {
            layout,
            activation: case.activation,
            tokens,
            x: x_shard.data(),
            dy: dy_shard.data(),
            weight: conv.weight.data(),
            bias: conv.bias.as_ref().map(|b| b.data()),
            documents: case.cu_seqlens.as_deref().map(|cu| (cu, start)),
        },
    )?;
    let mut op = ShortConv::new(rt, layout)?;
    let first = shard.call(&mut op, &stream)?;

    let mut problems = Vec::new();
    let mut errors = Vec::new();
    let mut check = |what: &str, got: Vec<f64>, want: &[f64]| {
        let err = rel_err(&got, want);
        errors.push(format!("{what} {err:.2e}"));
        if err.is_nan() || err > TOL {
            problems.push(format!("{what} rel err {err:.3e} > {TOL:e}"));
        }
    };
    check(
        "y",
        bf16_values(&first.y),
        &shard_rows(&want_y, start, tokens),
    );
    check(
        "dx",
        bf16_values(&first.dx),
        &shard_rows(&want_dx, start, tokens),
    );
    check(
        "d_weight",
        f32_values(&first.d_weight),
        local.d_weight.data(),
    );
    if let Some(d_bias) = &local.d_bias {
        check("d_bias", f32_values(&first.d_bias), d_bias.data());
    }
    let want_halo: Vec<u16> = bf16s(want_fwd.halos[me].data())
        .iter()
        .map(|v| v.to_bits())
        .collect();
    if shard.halo_len() > 0 && first.halo != want_halo {
        problems.push("the saved halo is not the reference's tokens".into());
    }

    if shard.call(&mut op, &stream)? != first {
        problems.push("a second call gave other bits".into());
    }
    if let Err(e) = replay(rt, &mut op, &mut shard, graph_calls, &first)? {
        problems.push(e);
    }
    op.free()?;
    let detail = format!("rel err {}", errors.join(" "));
    Ok(if problems.is_empty() {
        Ok(format!(
            "{detail}, halo exact, repeat and {graph_calls} graph replays bitwise equal"
        ))
    } else {
        Err(format!("{detail}: {}", problems.join("; ")))
    })
}

/// One forward + backward captured into a graph and replayed `calls` times on poisoned outputs:
/// whether each direction's epoch advanced by `calls` and the bits equal `want`.
fn replay(
    rt: &Runtime,
    op: &mut ShortConv,
    shard: &mut Shard,
    calls: u32,
    want: &Bits,
) -> Result<std::result::Result<(), String>> {
    let stream = rt.stream().clone();
    shard.poison(&stream)?;
    let before = op.calls(&stream)?;
    rt.barrier_on_stream(&stream)?;
    stream.synchronize()?;
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = shard
        .forward(op, &stream)
        .and_then(|_| shard.backward(op, &stream));
    let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
    captured?;
    let graph = graph.ok_or_else(|| Error::State("the capture recorded nothing".into()))?;
    for _ in 0..calls {
        graph.launch()?;
    }
    op.finish(&stream)?;
    let after = op.calls(&stream)?;
    let n = u64::from(calls);
    Ok(if after != (before.0 + n, before.1 + n) {
        Err(format!(
            "graph replay: epochs {before:?} -> {after:?} for {calls} replays"
        ))
    } else if &shard.bits(&stream)? != want {
        Err(format!("{calls} graph replays gave other bits"))
    } else {
        Ok(())
    })
}

/// A timing row: the slowest PE's median per direction.
#[derive(Serialize)]
struct Row {
    #[serde(rename = "W")]
    w: usize,
    #[serde(rename = "B")]
    b: usize,
    #[serde(rename = "T_local")]
    t_local: usize,
    #[serde(rename = "C")]
    c: usize,
    #[serde(rename = "K")]
    k: usize,
    activation: String,
    forward_ms: f64,
    backward_ms: f64,
    /// x read and y written, over the forward's time.
    forward_gb_per_s: f64,
    /// x and dy read and dx written, over the backward's time.
    backward_gb_per_s: f64,
}

const WARM_CALLS: usize = 3;
const TIMED_CALLS: usize = 30;

/// This PE's median ms of `call` (CUDA events around each call, after an on-stream barrier),
/// then the slowest PE's.
fn median_ms(rt: &Runtime, mut call: impl FnMut(&Arc<CudaStream>) -> Result<()>) -> Result<f64> {
    let stream = rt.stream().clone();
    let mut times = Vec::with_capacity(TIMED_CALLS);
    for i in 0..WARM_CALLS + TIMED_CALLS {
        rt.barrier_on_stream(&stream)?;
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        call(&stream)?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.synchronize()?;
        if i >= WARM_CALLS {
            times.push(f64::from(start.elapsed_ms(&end)?));
        }
    }
    times.sort_by(f64::total_cmp);
    let mine = times[times.len() / 2];
    let all = rt.all_gather_u64(mine.to_bits())?;
    Ok(all.into_iter().map(f64::from_bits).fold(0.0, f64::max))
}

fn time_shape(
    rt: &Runtime,
    (b, t, c): (usize, usize, usize),
    k: usize,
    activation: Activation,
) -> Result<Row> {
    let stream = rt.stream().clone();
    let layout = ShortConvLayout {
        batch: b,
        channels: c,
        kernel_size: k,
    };
    let mut rng = SplitMix64::new(23 + rt.pe() as u64);
    let mut values =
        |len: usize, scale: f64| -> Vec<f64> { (0..len).map(|_| rng.normal() * scale).collect() };
    let activations = b * t * c;
    let (x, dy) = (values(activations, 1.0), values(activations, 1.0));
    let (weight, bias) = (values(c * k, 0.5), values(c, 0.2));
    let mut shard = Shard::upload(
        &stream,
        HostShard {
            layout,
            activation,
            tokens: t,
            x: &x,
            dy: &dy,
            weight: &weight,
            bias: Some(&bias),
            documents: None,
        },
    )?;
    let mut op = ShortConv::new(rt, layout)?;
    let forward_ms = median_ms(rt, |s| shard.forward(&mut op, s))?;
    shard.forward(&mut op, &stream)?;
    let backward_ms = median_ms(rt, |s| shard.backward(&mut op, s))?;
    op.finish(&stream)?;
    op.free()?;
    let bytes = (activations * std::mem::size_of::<bf16>()) as f64;
    let row = Row {
        w: rt.npes(),
        b,
        t_local: t,
        c,
        k,
        activation: format!("{activation:?}"),
        forward_ms: round(forward_ms, 4),
        backward_ms: round(backward_ms, 4),
        forward_gb_per_s: round(2.0 * bytes / forward_ms / 1e6, 1),
        backward_gb_per_s: round(3.0 * bytes / backward_ms / 1e6, 1),
    };
    if rt.pe() == 0 {
        println!(
            "W={} B={b} T_local={t} C={c} K={k} {activation:?}: forward {:.4} ms ({} GB/s), backward {:.4} ms ({} GB/s)",
            row.w, row.forward_ms, row.forward_gb_per_s, row.backward_ms, row.backward_gb_per_s
        );
    }
    Ok(row)
}

/// The fault drill: every PE but `silent` calls forward and backward once; the PEs beside the
/// silent one must fail within the wait bound naming it (its successor misses its halo, its
/// predecessor the halo's gradient).
fn silent_drill(rt: &Runtime, silent: usize) -> Result<bool> {
    let stream = rt.stream().clone();
    let layout = ShortConvLayout {
        batch: 1,
        channels: 64,
        kernel_size: 4,
    };
    let tokens = 64;
    let halves = vec![0.5; tokens * 64];
    let weight = vec![0.25; 64 * 4];
    let mut shard = Shard::upload(
        &stream,
        HostShard {
            layout,
            activation: Activation::Identity,
            tokens,
            x: &halves,
            dy: &halves,
            weight: &weight,
            bias: None,
            documents: None,
        },
    )?;
    let mut op = ShortConv::new(rt, layout)?;
    if rt.pe() == silent {
        println!("PE {} stays silent (fault drill)", rt.pe());
        std::thread::sleep(rt.wait_timeout() + Duration::from_secs(10));
        return Err(Error::State(
            "the fault drill expected the PEs beside it to fail first".into(),
        ));
    }
    let result = shard
        .forward(&mut op, &stream)
        .and_then(|()| shard.backward(&mut op, &stream))
        .and_then(|()| op.finish(&stream));
    if let Err(e) = &result {
        // The launcher stops the other PEs once the first exits: print what this one names first.
        println!("PE {} drill error: {e}", rt.pe());
        std::thread::sleep(Duration::from_secs(3));
    }
    result.map(|()| true)
}

fn run(options: Options, config: Config) -> Result<bool> {
    let rt = Runtime::init(config)?;
    if let Some(silent) = options.silent_rank {
        return silent_drill(&rt, silent).and_then(|ok| rt.shutdown().map(|()| ok));
    }
    let mut failed = 0;
    if !options.no_check {
        failed = run_cases(&rt, &cases(rt.npes()), 7100, |case, seed| {
            check_case(&rt, case, seed, options.graph_calls)
        })?;
    }
    let rows = options
        .time
        .iter()
        .map(|&shape| {
            let activation = if options.identity {
                Activation::Identity
            } else {
                Activation::Silu
            };
            time_shape(&rt, shape, options.kernel_size, activation)
        })
        .collect::<Result<Vec<_>>>()?;
    if let (Some(path), 0, false) = (&options.json, rt.pe(), rows.is_empty()) {
        write_json(path, &rows)?;
    }
    rt.shutdown()?;
    Ok(failed == 0)
}

/// The halo buffers are small: 16 MiB covers B x (K - 1) x C up to a million floats a direction.
fn config(_: &Options, _npes: usize) -> Result<Config> {
    config_with_heap(16 << 20)
}

fn main() {
    // SAFETY: first thing in main: no thread has been started and no CUDA call made.
    unsafe { main_under_launcher("short_conv", Options::parse(), config, run) }
}
