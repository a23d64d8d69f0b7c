//! Prefix determinism of the whole model, bit for bit: a row's logits and K/V do not
//! depend on batch composition, on how its sequence was chunked, or on how many queries
//! ran in one forward. The negative control runs the same check with candle's stock
//! matmul and asserts that it fails.

mod common;

use common::invariance::{cache_bytes, run_chunked};
use common::{bits, fixture, Lcg};
use mtp::base::WeightDtype;
use mtp::kernels::negative_control;
use mtp::model::{Logits, Model, RowInput};
use mtp::synth::SynthSpec;

fn random_seq(rng: &mut Lcg, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| rng.below(vocab) as u32).collect()
}

/// True when every chunking of `seq` gives the token-by-token logits and cache.
fn chunking_invariant(model: &Model, seq: &[u32]) -> bool {
    let (one_by_one, c1) = run_chunked(model, seq, &[1]);
    [&[seq.len()][..], &[5], &[3, 17, 2], &[32, 1]].iter().all(|chunks| {
        let (l, c) = run_chunked(model, seq, chunks);
        l == one_by_one && cache_bytes(&c) == cache_bytes(&c1)
    })
}

#[test]
fn query_in_a_block_equals_query_alone_for_every_family() {
    let mut rng = Lcg(11);
    for name in ["llama-target", "qwen2-target", "qwen3-target"] {
        let model = common::load(&fixture(name));
        for len in [1, 9, 33, 70] {
            let seq = random_seq(&mut rng, len, model.config.vocab_size);
            assert!(chunking_invariant(&model, &seq), "{name}: chunking changed bits at len {len}");
        }
    }
}

/// True when a probe row decoded one token at a time gives the same logits and K/V alone as
/// when every forward it takes part in also carries five other rows.
fn batch_invariant(model: &Model, rng: &mut Lcg) -> bool {
    {
        let vocab = model.config.vocab_size;
        let probe = random_seq(rng, 21, vocab);
        let (alone, alone_cache) = run_chunked(model, &probe, &[1]);
        // The probe row shares every forward with rows of other lengths and window sizes.
        let others: Vec<Vec<u32>> = (0..5).map(|i| random_seq(rng, 3 + 11 * i, vocab)).collect();
        let mut caches: Vec<_> = (0..6).map(|_| model.new_cache()).collect();
        let mut got: Vec<Vec<u32>> = Vec::new();
        let mut at = [0usize; 6];
        while at[0] < probe.len() {
            let windows: Vec<&[u32]> = (0..6)
                .map(|r| {
                    let seq = if r == 0 { &probe } else { &others[r - 1] };
                    let w = if r == 0 { 1 } else { 1 + (r * 3) % 5 };
                    let s = at[r].min(seq.len());
                    &seq[s..(s + w).min(seq.len())]
                })
                .collect();
            let mut rows: Vec<RowInput> = caches
                .iter_mut()
                .zip(&windows)
                .map(|(c, w)| RowInput {
                    tokens: w,
                    cache: c,
                    logits: Logits::All,
                    full_logits: true,
                    hidden: true.into(),
                })
                .collect();
            let out = model.forward(&mut rows).unwrap();
            drop(rows);
            for (c, w) in caches.iter_mut().zip(&windows) {
                c.commit_window(w.len());
            }
            got.extend(out[0].logits.iter().map(|l| bits(l)));
            for (r, w) in windows.iter().enumerate() {
                at[r] += w.len();
            }
        }
        got == alone && cache_bytes(&caches[0]) == cache_bytes(&alone_cache)
    }
}

#[test]
fn row_in_a_batch_equals_row_alone() {
    let mut rng = Lcg(12);
    for name in ["llama-target", "qwen2-target", "qwen3-target"] {
        let model = common::load(&fixture(name));
        assert!(batch_invariant(&model, &mut rng), "{name}: batch changed the probe row's logits or K/V");
    }
}

/// A synthetic checkpoint wide enough that stock matmul picks different kernels by M.
fn wide_model(dir: &std::path::Path) -> Model {
    let mut s = SynthSpec::preset("qwen3").unwrap();
    s.vocab_size = 512;
    s.hidden_size = 256;
    s.num_hidden_layers = 2;
    s.num_attention_heads = 4;
    s.num_key_value_heads = 2;
    s.head_dim = 64;
    s.intermediate_size = 512;
    s.max_position_embeddings = 256;
    s.dtype = WeightDtype::Bf16;
    s.seed = 5;
    s.write(dir).unwrap();
    common::load(dir)
}

#[test]
fn negative_control_stock_matmul_breaks_chunking_invariance() {
    let dir = std::env::temp_dir().join(format!("mtp-negctl-{}", std::process::id()));
    let model = wide_model(&dir);
    let mut rng = Lcg(13);
    let seq = random_seq(&mut rng, 40, model.config.vocab_size);
    // The row-invariant kernels pass on this model ...
    assert!(chunking_invariant(&model, &seq));
    // ... and the same check fails once candle's stock matmul is swapped in.
    negative_control::set_stock_matmul(true);
    let stock_ok = chunking_invariant(&model, &seq);
    negative_control::set_stock_matmul(false);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!stock_ok, "stock matmul passed the invariance check: the check cannot fail");
}

#[test]
fn negative_control_stock_matmul_breaks_batch_invariance() {
    let dir = std::env::temp_dir().join(format!("mtp-negctl-batch-{}", std::process::id()));
    let model = wide_model(&dir);
    assert!(batch_invariant(&model, &mut Lcg(14)));
    negative_control::set_stock_matmul(true);
    let stock_ok = batch_invariant(&model, &mut Lcg(14));
    negative_control::set_stock_matmul(false);
    std::fs::remove_dir_all(&dir).ok();
    assert!(!stock_ok, "stock matmul passed the batch check: the check cannot fail");
}

/// A row gets its hidden states back exactly when it asks (`RowInput::hidden`), whether
/// the batch beside it asks or not, with the bits of a forward where every row asks; the
/// logits do not depend on it. Both forwards: a prompt's (logits of the last token; the
/// hidden states downloaded or not) and a verify's (every token's logits: the outputs a
/// backend may record and replay, fetched or not). Control: the row that asks gets them
/// (not empty).
#[test]
fn hidden_states_come_back_only_to_rows_that_ask() {
    let mut rng = Lcg(23);
    let model = common::load(&fixture("qwen3-target"));
    let (vocab, h) = (model.config.vocab_size, model.config.hidden_size);
    let seqs: Vec<Vec<u32>> = [7, 12].iter().map(|&n| random_seq(&mut rng, n, vocab)).collect();
    for logits in [Logits::Last, Logits::All] {
        // Each row's (logits bits, hidden bits) with the rows asking as `asks` says.
        let run = |asks: [bool; 2]| {
            let mut caches: Vec<_> = (0..2).map(|_| model.new_cache()).collect();
            let mut rows: Vec<RowInput> = caches
                .iter_mut()
                .zip(&seqs)
                .zip(asks)
                .map(|((c, s), hidden)| RowInput {
                    tokens: s,
                    cache: c,
                    logits,
                    full_logits: true,
                    hidden: hidden.into(),
                })
                .collect();
            let out = model.forward(&mut rows).unwrap();
            out.iter()
                .map(|o| (o.logits.iter().map(|l| bits(l)).collect::<Vec<_>>(), bits(&o.hidden)))
                .collect::<Vec<_>>()
        };
        let both = run([true, true]);
        for (i, s) in seqs.iter().enumerate() {
            assert_eq!(
                both[i].1.len(),
                s.len() * h,
                "{logits:?}: row {i} asked for its hidden states and got none"
            );
        }
        for asks in [[true, false], [false, true], [false, false]] {
            let got = run(asks);
            for i in 0..2 {
                assert_eq!(got[i].0, both[i].0, "{logits:?}: row {i}'s logits moved with {asks:?}");
                let want = if asks[i] { both[i].1.clone() } else { Vec::new() };
                assert_eq!(got[i].1, want, "{logits:?}: row {i}'s hidden states with {asks:?}");
            }
        }
    }
}
