//! `mtp synth --like gemma4-31b|gemma4-e2b`: the presets' real shapes, `--layers` keeping
//! the layer pattern, and scaled-down checkpoints that the Gemma 4 loader runs.

use std::path::{Path, PathBuf};
use std::process::Command;

use mtp::engine::prefill;
use mtp::model::models::gemma4::{Gemma4Config, LayerKind};
use mtp::model::Model;
use mtp::synth::gemma4::Gemma4Spec;

fn mtp(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_mtp")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8(out.stderr).unwrap())
}

fn resolved(spec: &Gemma4Spec) -> Gemma4Config {
    Gemma4Config::from_value(Path::new("config.json"), &spec.config_json()).unwrap()
}

fn full_layers(g: &Gemma4Config) -> Vec<usize> {
    (0..g.layers.len()).filter(|&i| g.layers[i].kind == LayerKind::Full).collect()
}

fn params(spec: &Gemma4Spec) -> usize {
    let t = spec.tensors(Path::new("config.json")).unwrap();
    t.iter().map(|(_, s)| s.iter().product::<usize>()).sum()
}

#[test]
fn presets_have_the_real_shapes() {
    let s = Gemma4Spec::preset("gemma4-31b").unwrap();
    let g = resolved(&s);
    assert_eq!(full_layers(&g), (0..10).map(|i| 6 * i + 5).collect::<Vec<_>>());
    let (sl, fl) = (g.layers[0], g.layers[5]);
    assert_eq!((sl.head_dim, sl.kv_heads, sl.k_eq_v), (256, 16, false));
    assert_eq!((fl.head_dim, fl.kv_heads, fl.k_eq_v), (512, 4, true));
    assert!(g.layers.iter().all(|l| l.own_kv && l.intermediate == 21504));
    assert_eq!((g.sliding_window, g.final_logit_softcapping), (1024, Some(30.0)));
    let p = params(&s);
    println!("gemma4-31b: {p} parameters");
    assert!((30_000_000_000..31_500_000_000).contains(&p), "31B: {p} parameters");

    let s = Gemma4Spec::preset("gemma4-e2b").unwrap();
    let g = resolved(&s);
    assert_eq!(full_layers(&g), (0..7).map(|i| 5 * i + 4).collect::<Vec<_>>());
    assert_eq!(g.layers.iter().filter(|l| !l.own_kv).count(), 20);
    assert_eq!(g.layers[15].kv_source, Some(13));
    assert_eq!(g.layers[34].kv_source, Some(14));
    assert_eq!((g.layers[14].intermediate, g.layers[15].intermediate), (6144, 12288));
    assert_eq!((g.layers[4].head_dim, g.layers[4].kv_heads, g.layers[0].head_dim), (512, 1, 256));
    assert_eq!((g.per_layer_input, g.per_layer_vocab, g.sliding_window), (256, 262144, 512));
    let p = params(&s);
    println!("gemma4-e2b: {p} parameters");
    assert!((4_500_000_000..5_200_000_000).contains(&p), "E2B: {p} parameters");
}

#[test]
fn fewer_layers_keep_the_pattern_and_valid_sharing() {
    let mut s = Gemma4Spec::preset("gemma4-31b").unwrap();
    s.set_layers(8);
    assert_eq!(full_layers(&resolved(&s)), vec![5, 7]);
    for (n, shared) in [(35, 20), (10, 5), (6, 1), (5, 0), (4, 0), (1, 0)] {
        let mut s = Gemma4Spec::preset("gemma4-e2b").unwrap();
        s.set_layers(n);
        assert_eq!(s.num_kv_shared_layers, shared, "{n} layers");
        let g = resolved(&s);
        assert_eq!(g.layers.last().unwrap().kind, LayerKind::Full);
    }
}

/// Writes a scaled-down preset through the CLI and runs a forward on it.
fn synth_and_run(like: &str, layers: &str) -> Gemma4Config {
    let dir: PathBuf = std::env::temp_dir().join(format!("mtp-synth-{like}-{}", std::process::id()));
    let d = dir.to_str().unwrap();
    let small =
        ["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--intermediate", "96"];
    let args =
        [&["synth", "--like", like, "--layers", layers, "--vocab", "512", "--out", d][..], &small].concat();
    let (code, err) = mtp(&args);
    assert_eq!(code, 0, "{like}: {err}");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let g =
        Gemma4Config::from_value(&dir.join("config.json"), &serde_json::from_str(&text).unwrap()).unwrap();
    let model = Model::load(&dir).unwrap_or_else(|e| panic!("{like}: {e}"));
    assert_eq!(model.config.vocab_size, 512);
    let mut cache = model.new_cache();
    let mtp::engine::Prefilled { logits, .. } =
        prefill(&model, &mut cache, &[2, 17, 300, 42, 511], 3, false, true).unwrap();
    assert_eq!(logits.len(), 512);
    assert!(logits.iter().all(|l| l.is_finite() && l.abs() <= 30.0), "{like}: {logits:?}");
    std::fs::remove_dir_all(&dir).unwrap();
    g
}

#[test]
fn scaled_down_presets_load_and_run() {
    let g = synth_and_run("gemma4-31b", "6");
    assert_eq!(full_layers(&g), vec![5]);
    assert_eq!((g.layers[0].head_dim, g.layers[0].kv_heads), (16, 2));
    assert_eq!((g.layers[5].head_dim, g.layers[5].kv_heads, g.layers[5].k_eq_v), (32, 4, true));

    let g = synth_and_run("gemma4-e2b", "10");
    assert_eq!(full_layers(&g), vec![4, 9]);
    assert_eq!(
        g.layers.iter().map(|l| l.kv_source).collect::<Vec<_>>()[5..],
        [Some(3), Some(3), Some(3), Some(3), Some(4)]
    );
    assert_eq!((g.layers[4].intermediate, g.layers[9].intermediate), (96, 192));
    assert_eq!((g.layers[9].head_dim, g.per_layer_input), (32, 256));
}

#[test]
fn unknown_presets_are_refused_listing_them() {
    let (code, err) = mtp(&["synth", "--like", "gemma5", "--out", "/nonexistent"]);
    assert_ne!(code, 0);
    assert!(err.contains("gemma5") && err.contains("gemma4-31b") && err.contains("gemma4-e2b"), "{err}");
    let out = std::env::temp_dir().join(format!("mtp-synth-bad-{}", std::process::id()));
    let small = ["--layers", "1", "--hidden", "64", "--intermediate", "64", "--vocab", "512"];
    let args =
        [&["synth", "--like", "gemma4-31b", "--kv-heads", "5", "--out", out.to_str().unwrap()][..], &small];
    let (code, err) = mtp(&args.concat());
    assert!(code != 0 && err.contains("num_key_value_heads"), "{err}");
    assert!(!out.exists(), "nothing is written for a refused shape");
}
