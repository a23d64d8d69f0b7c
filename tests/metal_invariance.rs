//! The Metal kernels, bit for bit, on this platform's Metal: the Apple GPU on macOS
//! (`--features metal`, `scripts/metal-test.sh`), the emulator elsewhere (CI). The emulator
//! itself behaves like a GPU where it matters (barriers, threadgroup memory, SIMD-group
//! exchanges; a missing barrier, a divergent barrier and a write past a buffer's end are
//! caught). Every matmul row gets the same bits whatever M is (a split-K kernel that picks
//! its splits from M does not), a query's attention is the same alone as in a batch (a
//! batch-sized split does not), and the kernels compute the CPU's function within 1e-4 of
//! the logits' scale. The parity gate, golden and invariance suites run on Metal too:
//! `.ci/run` runs them with `--features metal-emulator` and `MTP_TEST_BACKEND=metal-emulated`.
#![cfg(any(
    all(target_os = "macos", feature = "metal"),
    all(not(target_os = "macos"), feature = "metal-emulator")
))]

mod common;

use std::sync::Arc;

use common::invariance::{
    attention_batch_invariant_and_control, logits_vs_cpu, rows_invariant_and_control, weight,
};
use common::Lcg;
use mtp::base::WeightDtype;
use mtp::kernels::cpu::Cpu;
use mtp::kernels::{Backend, Kernels};
use mtp::metal::Metal;

#[cfg(target_os = "macos")]
fn metal() -> (Arc<Metal<mtp::metal::apple::Apple>>, Backend) {
    (mtp::metal::apple::Apple::shared().unwrap(), Backend::Metal)
}

#[cfg(not(target_os = "macos"))]
fn metal() -> (Arc<Metal<mtp::metal::emulated::Emulator>>, Backend) {
    (mtp::metal::emulated::Emulator::shared(), Backend::MetalEmulated)
}

#[test]
fn matmul_rows_do_not_depend_on_m_and_split_k_rows_do() {
    let (metal, _) = metal();
    let mut rng = Lcg(3);
    let ms = [1, 2, 3, 5, 8, 9, 17, 40];
    // Every weight dtype, K a multiple of 256 and not of 8 (the kernels' ragged tail).
    for (dtype, n, k) in [
        (WeightDtype::Bf16, 96, 512),
        (WeightDtype::F16, 40, 300),
        (WeightDtype::F32, 33, 97),
        (WeightDtype::Bf16, 17, 100),
    ] {
        let w = weight(&mut rng, dtype, n, k);
        let x = rng.vec(40 * k);
        let (ours, stock) = rows_invariant_and_control(&*metal, &w, &x, &ms);
        assert!(ours, "{n}x{k} {}: a row's bits depend on M", dtype.name());
        assert!(!stock, "{n}x{k}: the split-K control gave every M the same bits: the check cannot fail");
    }
}

#[test]
fn attention_alone_equals_batched_and_batch_sized_splits_do_not() {
    let (ours, control) = attention_batch_invariant_and_control(metal().1);
    assert!(ours, "a query's attention bits depend on the batch");
    assert!(!control, "a split count chosen from the batch went unnoticed");
}

/// `gate <- op(gate, up)` on the CPU and on `metal`: the largest difference relative to the
/// CPU's value (floored at 1e-3).
fn vs_cpu<M: Kernels>(
    metal: &M,
    cpu_op: impl Fn(&mut Vec<f32>, &Vec<f32>),
    metal_op: impl Fn(&mut M::Act, &M::Act),
) -> f32 {
    let mut rng = Lcg(9);
    let (gate, up) = (rng.vec(1000), rng.vec(1000));
    let mut on_cpu = gate.clone();
    cpu_op(&mut on_cpu, &up);
    let (mut g, u) = (metal.upload(&gate).unwrap(), metal.upload(&up).unwrap());
    metal_op(&mut g, &u);
    let on_metal = metal.download(g).unwrap();
    on_cpu.iter().zip(&on_metal).map(|(a, b)| (a - b).abs() / a.abs().max(1e-3)).fold(0.0f32, f32::max)
}

/// The Metal kernels compute the CPU's function: logits within 1e-4 of their scale for every
/// weight dtype, and the elementwise ops within a few ulps.
#[test]
fn metal_kernels_agree_with_the_cpu() {
    let (metal, backend) = metal();
    for (dtype, worst, scale) in logits_vs_cpu(backend, mtp::kernels::Activations::Auto) {
        assert!(worst <= 1e-4 * scale.max(1.0), "{}: Metal and CPU logits differ by {worst}", dtype.name());
    }
    let swiglu =
        vs_cpu(&*metal, |g, u| Cpu::default().swiglu(g, u).unwrap(), |g, u| metal.swiglu(g, u).unwrap());
    let gelu = vs_cpu(
        &*metal,
        |g, u| Cpu::default().gelu_tanh_mul(g, u).unwrap(),
        |g, u| metal.gelu_tanh_mul(g, u).unwrap(),
    );
    println!("relative differences: swiglu {swiglu:e}, gelu_tanh_mul {gelu:e}");
    assert!(swiglu <= 1e-6 && gelu <= 1e-5, "swiglu {swiglu}, gelu {gelu}");
}

/// The emulator itself (not built on macOS).
#[cfg(not(target_os = "macos"))]
mod emulator {
    use mtp::metal::emulated::Emulator;
    use mtp::metal::{Arg, Dispatch};

    fn floats(d: &Emulator, buf: &<Emulator as Dispatch>::Buffer, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; 4 * n];
        d.read(buf, 0, &mut bytes).unwrap();
        bytes.chunks_exact(4).map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    fn upload(d: &Emulator, x: &[f32]) -> <Emulator as Dispatch>::Buffer {
        d.upload(&x.iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>()).unwrap()
    }

    #[test]
    fn emulator_runs_barriers_threadgroup_memory_and_simd_exchanges() {
        let metal = Emulator::shared();
        let d = metal.dispatch();
        let x: Vec<f32> = (0..3 * 256).map(|i| i as f32 * 0.5 - 7.0).collect();
        let (xb, out) = (upload(d, &x), d.alloc(4 * x.len()).unwrap());
        d.run("selftest_reverse", (3, 1), 256, &[Arg::In(&xb, 0), Arg::Out(&out, 0)]).unwrap();
        let want: Vec<f32> = (0..x.len()).map(|i| x[i / 256 * 256 + 255 - i % 256]).collect();
        assert_eq!(floats(d, &out, x.len()), want);

        // SIMD-groups of two 64-thread threadgroups: a butterfly sum, a broadcast, an xor swap.
        let x: Vec<f32> = (0..128).map(|i| ((i * 37) % 101) as f32 / 7.0 - 3.0).collect();
        let (xb, out) = (upload(d, &x), d.alloc(4 * 3 * 128).unwrap());
        d.run("selftest_simd", (2, 1), 64, &[Arg::In(&xb, 0), Arg::Out(&out, 0)]).unwrap();
        let got = floats(d, &out, 3 * 128);
        for simd in 0..4 {
            let mut v: Vec<f32> = x[32 * simd..32 * simd + 32].to_vec();
            for o in [16, 8, 4, 2, 1] {
                v = (0..32).map(|l| v[l] + v[l ^ o]).collect();
            }
            for l in 0..32 {
                let i = 32 * simd + l;
                assert_eq!(got[3 * i].to_bits(), v[l].to_bits(), "butterfly sum, lane {i}");
                assert_eq!(got[3 * i + 1], x[32 * simd + 7], "broadcast, lane {i}");
                assert_eq!(got[3 * i + 2], x[32 * simd + (l ^ 5)], "xor shuffle, lane {i}");
            }
        }
    }

    /// Negative control for the emulator: threads that read threadgroup memory another thread
    /// writes, without a barrier between, get wrong values (as on a GPU), so a kernel missing a
    /// barrier fails its tests here instead of passing by luck.
    #[test]
    fn emulator_exposes_a_missing_barrier() {
        let metal = Emulator::shared();
        let d = metal.dispatch();
        let run = |name: &'static str, offset: f32| {
            let x: Vec<f32> = (0..256).map(|i| i as f32 + offset).collect();
            let (xb, out) = (upload(d, &x), d.alloc(4 * 256).unwrap());
            d.run(name, (1, 1), 256, &[Arg::In(&xb, 0), Arg::Out(&out, 0)]).unwrap();
            let want: Vec<f32> = (0..256).map(|i| x[255 - i]).collect();
            floats(d, &out, 256) == want
        };
        assert!(run("selftest_reverse", 1000.0));
        assert!(!run("selftest_reverse_unsynchronized", 2000.0), "a missing barrier went unnoticed");
    }

    #[test]
    fn emulator_reports_divergent_barriers_and_writes_past_the_end() {
        let metal = Emulator::shared();
        let d = metal.dispatch();
        let out = d.alloc(4 * 64).unwrap();
        let err =
            d.run("selftest_divergent_barrier", (1, 1), 64, &[Arg::Out(&out, 0)]).unwrap_err().to_string();
        assert!(err.contains("deadlocked") && err.contains("selftest_divergent_barrier"), "{err}");
        let err = d
            .run("selftest_write_past_end", (1, 1), 32, &[Arg::Out(&out, 0), Arg::I32(64)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("wrote past the end of argument 0"), "{err}");
        let fresh = d.alloc(4 * 64).unwrap();
        d.run("selftest_write_past_end", (1, 1), 32, &[Arg::Out(&fresh, 0), Arg::I32(63)]).unwrap();
        let err = d.run("no_such_kernel", (1, 1), 32, &[]).unwrap_err().to_string();
        assert!(err.contains("no kernel `no_such_kernel`"), "{err}");
        // The emulator stays usable after an error.
        emulator_runs_barriers_threadgroup_memory_and_simd_exchanges();
    }
}
