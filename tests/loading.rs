//! Loading real checkpoints, and clear errors (never panics) on bad ones.

mod common;

use std::path::{Path, PathBuf};

use common::fixture;
use mtp::base::{Config, Error, Tokenizer};
use mtp::drafter::DraftAsk;
use mtp::model::Model;

/// A writable copy of a fixture checkpoint.
fn copy_fixture(name: &str, tag: &str) -> PathBuf {
    copy_dir(&fixture(name), tag)
}

/// A writable copy of the checkpoint in `src`.
fn copy_dir(src: &Path, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mtp-load-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    dir
}

/// Appends zero-filled F32 tensors `extra` (name, shape) to the safetensors `file`.
fn add_tensors(file: &Path, extra: &[(&str, &[usize])]) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut data = bytes[8 + n..].to_vec();
    for (name, shape) in extra {
        let at = data.len();
        data.resize(at + 4 * shape.iter().product::<usize>(), 0);
        let entry = serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, data.len()]});
        header.insert(name.to_string(), entry);
    }
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    std::fs::write(file, out).unwrap();
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_files_are_named() {
    let dir = copy_fixture("qwen3-draft", "missing");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(load_err(&dir).contains("model.safetensors"));
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(load_err(&dir).contains("config.json"));
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(Tokenizer::from_dir(&dir).err().unwrap().to_string().contains("tokenizer.json"));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn unknown_architecture_is_named() {
    let dir = copy_fixture("qwen3-draft", "arch");
    edit_config(&dir, |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    let e = load_err(&dir);
    assert!(e.contains("GPT2LMHeadModel") && e.contains("config.json"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_json_is_named() {
    let dir = copy_fixture("qwen3-draft", "json");
    std::fs::write(dir.join("generation_config.json"), "{\"eos_token_id\": [0, ").unwrap();
    let e = load_err(&dir);
    assert!(e.contains("generation_config.json") && e.contains("invalid JSON"), "{e}");
    std::fs::write(dir.join("config.json"), "not json").unwrap();
    assert!(load_err(&dir).contains("config.json"));
    std::fs::remove_dir_all(dir).ok();
}

/// A config, generation config or index that is JSON but not an object is refused
/// saying so (the config's error said "key ``"; the others read as files of no keys).
/// Control: the same files as objects load.
#[test]
fn json_files_that_are_not_objects_are_named() {
    let dir = copy_fixture("qwen3-draft", "json-kind");
    Model::load(&dir).expect("control: the fixture loads");
    let config = std::fs::read(dir.join("config.json")).unwrap();
    for (file, body, got) in [
        ("config.json", "[1, 2]", "an array"),
        ("generation_config.json", "\"eos\"", "a string"),
        ("model.safetensors.index.json", "7", "a number"),
    ] {
        std::fs::write(dir.join("config.json"), &config).unwrap();
        std::fs::write(dir.join(file), body).unwrap();
        let e = load_err(&dir);
        assert!(e.contains(file) && e.contains(&format!("expected a JSON object, got {got}")), "{file}: {e}");
        std::fs::remove_file(dir.join(file)).ok();
    }
    std::fs::remove_dir_all(dir).ok();
}

/// A safetensors header whose shape or offsets lie is refused naming the tensor that
/// lies (the safetensors crate named none for a shape, and for overlapping offsets the
/// tensor second by offset, whichever told the lie).
#[test]
fn safetensors_header_lies_name_their_tensor() {
    let dir = copy_fixture("qwen3-draft", "header-lie");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let write = |h: &serde_json::Map<String, serde_json::Value>| {
        let mut text = serde_json::to_vec(h).unwrap();
        text.resize(n.max(text.len()), b' ');
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend(text);
        out.extend_from_slice(&bytes[8 + n..]);
        std::fs::write(&file, out).unwrap();
    };
    let by_offset = |h: &serde_json::Map<String, serde_json::Value>| {
        let mut names: Vec<String> = h.keys().filter(|k| *k != "__metadata__").cloned().collect();
        names.sort_by_key(|k| h[k]["data_offsets"][0].as_u64().unwrap());
        names
    };
    let names = by_offset(&header);
    // The first tensor by offset claims one more row than its bytes hold.
    let mut shape = header.clone();
    let first = &names[0];
    let rows = shape[first]["shape"][0].as_u64().unwrap();
    shape[first]["shape"][0] = (rows + 1).into();
    write(&shape);
    let e = load_err(&dir);
    assert!(e.contains("model.safetensors") && e.contains(&format!("tensor `{first}`: shape")), "{e}");
    // The second tensor's offsets moved back onto the first's bytes (the third's then start
    // past its end: only the overlap is reported, naming the two that share bytes).
    let mut overlap = header.clone();
    let second = &names[1];
    let [s, e2] = [0, 1].map(|i| overlap[second]["data_offsets"][i].as_u64().unwrap());
    overlap[second]["data_offsets"] = serde_json::json!([s - 4, e2 - 4]);
    write(&overlap);
    let e = load_err(&dir);
    assert!(e.contains(&format!("tensors `{first}` and `{second}` share bytes")), "{e}");
    write(&header);
    Model::load(&dir).expect("control: the header as written loads");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bad_config_values_name_the_key() {
    let dir = copy_fixture("qwen3-draft", "key");
    edit_config(&dir, |v| v["hidden_size"] = serde_json::json!("wide"));
    assert!(load_err(&dir).contains("hidden_size"));
    edit_config(&dir, |v| {
        v["hidden_size"] = serde_json::json!(48);
        v.as_object_mut().unwrap().remove("vocab_size");
    });
    assert!(load_err(&dir).contains("vocab_size"));
    std::fs::remove_dir_all(dir).ok();
}

/// Impossible numbers are refused at load, naming the key: before, an epsilon of -1 or a
/// RoPE base of 0 ran and emitted token 0 with a null logprob, and a huge context panicked
/// (`capacity overflow`) or aborted the process building the RoPE table. Control: the
/// unedited config loads, so the refusals come from the values alone.
#[test]
fn impossible_config_numbers_name_the_key() {
    let dir = copy_fixture("qwen3-draft", "numbers");
    let original = std::fs::read_to_string(dir.join("config.json")).unwrap();
    Model::load(&dir).expect("the unedited config loads");
    let cases: [(&str, serde_json::Value); 9] = [
        ("rms_norm_eps", serde_json::json!(-1.0)),
        ("rms_norm_eps", serde_json::json!(0.0)),
        ("rope_theta", serde_json::json!(0.0)),
        ("rope_theta", serde_json::json!(-10000.0)),
        ("max_position_embeddings", serde_json::json!(u64::MAX)),
        ("max_position_embeddings", serde_json::json!(1_000_000_000_000u64)),
        ("max_position_embeddings", serde_json::json!(0)),
        ("rms_norm_eps", serde_json::json!(1e39)),
        ("rope_theta", serde_json::json!(1e39)),
    ];
    for (key, value) in cases {
        std::fs::write(dir.join("config.json"), &original).unwrap();
        edit_config(&dir, |v| {
            v.as_object_mut().unwrap().remove("rope_parameters");
            v[key] = value.clone();
        });
        let e = load_err(&dir);
        assert!(e.contains(key) && e.contains("config.json"), "{key} = {value}: {e}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let dir = copy_fixture("qwen3-draft", "shape");
    // Claim a wider intermediate size than the weights have.
    edit_config(&dir, |v| v["intermediate_size"] = serde_json::json!(100));
    let e = load_err(&dir);
    assert!(e.contains("mlp.") && e.contains("shape") && e.contains("model.safetensors"), "{e}");
    // One more layer than the file holds (`layer_types` would have to list it too).
    edit_config(&dir, |v| {
        v["intermediate_size"] = serde_json::json!(96);
        v["num_hidden_layers"] = serde_json::json!(2);
        v.as_object_mut().unwrap().remove("layer_types");
    });
    let e = load_err(&dir);
    assert!(e.contains("missing tensor `model.layers.1."), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn truncated_safetensors_is_an_error() {
    let dir = copy_fixture("qwen3-draft", "trunc");
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    for keep in [4, 100, bytes.len() / 2, bytes.len() - 1] {
        std::fs::write(&p, &bytes[..keep]).unwrap();
        let e = load_err(&dir);
        assert!(e.contains("model.safetensors"), "{e}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn sharded_checkpoints_load() {
    // An index naming one shard must load and give the same logits as the single file.
    let dir = copy_fixture("qwen3-draft", "shard");
    std::fs::rename(dir.join("model.safetensors"), dir.join("model-00001-of-00001.safetensors")).unwrap();
    let single = Model::load(&fixture("qwen3-draft")).unwrap();
    let names: Vec<String> = {
        let b = std::fs::read(dir.join("model-00001-of-00001.safetensors")).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
        h.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect()
    };
    let map: serde_json::Map<String, serde_json::Value> =
        names.into_iter().map(|n| (n, "model-00001-of-00001.safetensors".into())).collect();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    let sharded = Model::load(&dir).unwrap();
    let run = |m: &Model| {
        let mut c = m.new_cache();
        mtp::engine::prefill(m, &mut c, &[5, 6, 7], 8, false, true).unwrap().logits
    };
    assert_eq!(common::bits(&run(&single)), common::bits(&run(&sharded)));
    // A tensor held by two shards, or the index placing it in a shard that does not hold
    // it, is refused naming the entry: which copy loads is the checkpoint's to say.
    let second = dir.join("model-00002-of-00002.safetensors");
    let write_index = |m: &serde_json::Map<String, serde_json::Value>| {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::json!({"weight_map": m}).to_string(),
        )
        .unwrap()
    };
    let mut moved = map.clone();
    moved.insert("model.embed_tokens.weight".into(), "model-00002-of-00002.safetensors".into());
    std::fs::copy(dir.join("model-00001-of-00001.safetensors"), &second).unwrap();
    write_index(&moved);
    let e = load_err(&dir);
    // (Whichever shard is read first, its copy or the other's placement is the refusal.)
    assert!(e.contains("weight_map.") && e.contains("stored in"), "{e}");
    let data = [0u8; 4];
    let extra = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &data).unwrap();
    safetensors::tensor::serialize_to_file([("extra.weight", extra)], None, &second).unwrap();
    let e = load_err(&dir);
    assert!(
        e.contains("weight_map.model.embed_tokens.weight")
            && e.contains("but the tensor is stored in model-00001"),
        "{e}"
    );
    std::fs::remove_file(&second).unwrap();
    // Control: an index that omits a tensor its shard holds loads it (as transformers does).
    let mut fewer = map.clone();
    fewer.remove("model.embed_tokens.weight");
    write_index(&fewer);
    assert_eq!(common::bits(&run(&single)), common::bits(&run(&Model::load(&dir).unwrap())));
    // A shard named outside the directory is refused naming the entry (it was opened).
    for outside in ["../../../../etc/passwd", "/etc/passwd", "sub/../model-00001-of-00001.safetensors"] {
        let mut bad = map.clone();
        bad.insert("lm_head.weight".into(), outside.into());
        let index = serde_json::json!({"weight_map": bad}).to_string();
        std::fs::write(dir.join("model.safetensors.index.json"), index).unwrap();
        let e = load_err(&dir);
        assert!(
            e.contains("weight_map.lm_head.weight") && e.contains("not the name of a file"),
            "{outside}: {e}"
        );
    }
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn config_spellings_old_and_new() {
    let p = Path::new("config.json");
    let base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "eos_token_id": 7, "rope_theta": 500000.0
    });
    let c = Config::from_value(p, &base).unwrap();
    assert_eq!(
        (c.rope_theta, c.eos_token_ids.clone(), c.head_dim, c.num_key_value_heads),
        (500000.0, vec![7], 4, 2)
    );
    let mut v = base.clone();
    v["rope_parameters"] = serde_json::json!({"rope_theta": 1000.0, "rope_type": "default"});
    v["eos_token_id"] = serde_json::json!([1, 2]);
    let c = Config::from_value(p, &v).unwrap();
    assert_eq!((c.rope_theta, c.eos_token_ids), (1000.0, vec![1, 2]));
    let mut v = base.clone();
    v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let s = Config::from_value(p, &v).unwrap().rope_scaling.unwrap();
    // High frequencies are kept, low ones divided by the factor.
    assert_eq!(s.adjust(1.0), 1.0);
    assert_eq!(s.adjust(1e-5), 1e-5 / 32.0);
    v["rope_scaling"]["rope_type"] = "yarn".into();
    assert!(Config::from_value(p, &v).unwrap_err().to_string().contains("rope_type"));
    let mut v = base;
    v["num_key_value_heads"] = 3.into();
    assert!(matches!(Config::from_value(p, &v), Err(Error::Config { .. })));
}

#[test]
fn generation_config_eos_ids_join_the_config() {
    let dir = copy_fixture("llama-draft", "eos");
    edit_config(&dir, |v| v["eos_token_id"] = serde_json::json!(2));
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [2, 9]}"#).unwrap();
    assert_eq!(Config::from_dir(&dir).unwrap().eos_token_ids, vec![2, 9]);
    std::fs::remove_dir_all(dir).ok();
}

fn request(id: &str, prompt: Vec<u32>) -> mtp::engine::Request {
    common::request(id, prompt, 4)
}

#[test]
fn prompts_over_the_context_fail_alone() {
    let model = Model::load(&fixture("qwen2-draft")).unwrap();
    let ok = request("ok", vec![3, 4, 5]);
    let long = request("long", vec![3; 5000]);
    let bad_id = request("oov", vec![100000]);
    let out = common::plain(&model, &[long, ok, bad_id], 8);
    let e = out[0].as_ref().unwrap_err().to_string();
    assert!(e.contains("long") && e.contains("context"), "{e}");
    assert_eq!(out[1].as_ref().unwrap().tokens.len(), 4);
    assert!(out[2].as_ref().unwrap_err().to_string().contains("vocabulary"));
}

#[test]
fn a_prompt_filling_the_whole_context_still_gets_its_token() {
    let model = Model::load(&fixture("qwen3-draft")).unwrap();
    let n = model.max_positions();
    let full = mtp::engine::Request { max_tokens: 5, ..request("full", vec![3; n]) };
    let near = mtp::engine::Request { max_tokens: 5, ..request("near", vec![3; n - 2]) };
    let out = common::plain(&model, &[full, near], 8);
    // No room to feed a token back: exactly one token, from the prefill logits.
    assert_eq!(out[0].as_ref().unwrap().tokens.len(), 1);
    // Two free positions: the prefill token plus two decode steps.
    assert_eq!(out[1].as_ref().unwrap().tokens.len(), 3);
}

fn tensor_names(file: &Path) -> Vec<String> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header.as_object().unwrap().keys().filter(|k| *k != "__metadata__").cloned().collect()
}

fn mtp_err(dir: &Path, target: &std::sync::Arc<Model>) -> String {
    match mtp::drafter::MtpDrafter::load(dir, target.clone()) {
        Ok(_) => panic!("{} loaded as an MTP head but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn mtp_heads_load_in_both_layouts_and_inside_the_target() {
    use mtp::drafter::{Commit, Drafter, MtpDrafter};
    use mtp::model::MtpLayout;
    use mtp::synth::SynthSpec;
    let target_dir = fixture("qwen2-target");
    let target = std::sync::Arc::new(Model::load(&target_dir).unwrap());
    let mut proposals = Vec::new();
    for layout in [MtpLayout::MiMo, MtpLayout::DeepSeek] {
        let dir =
            std::env::temp_dir().join(format!("mtp-load-head-{}-{}", layout.name(), std::process::id()));
        SynthSpec::write_mtp_head(&target_dir, layout, &dir, 3).unwrap();
        let mut d = MtpDrafter::load(&dir, target.clone()).unwrap();
        assert_eq!(d.head().layout, layout);
        let h = target.config.hidden_size;
        let hidden: Vec<f32> = (0..3 * h).map(|i| (i as f32 * 0.37).sin()).collect();
        d.commit(0, Commit { start: 0, tokens: &[4, 5, 6], hidden: &hidden, next: 7 }).unwrap();
        let p = d.propose(&[DraftAsk::greedy(0, 3)]).unwrap().remove(0).tokens;
        assert_eq!(p.len(), 3);
        proposals.push((dir, p));
    }
    // DeepSeek-V3 style: the head's tensors ship inside the target checkpoint, in a second
    // shard listed by model.safetensors.index.json.
    let (ds_dir, ds_proposal) = &proposals[1];
    let inside = copy_fixture("qwen2-target", "mtp-inside");
    std::fs::rename(inside.join("model.safetensors"), inside.join("model-00001-of-00002.safetensors"))
        .unwrap();
    std::fs::copy(ds_dir.join("model.safetensors"), inside.join("model-00002-of-00002.safetensors")).unwrap();
    let mut map = serde_json::Map::new();
    for shard in ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        for name in tensor_names(&inside.join(shard)) {
            map.insert(name, shard.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(inside.join("model.safetensors.index.json"), index.to_string()).unwrap();
    edit_config(&inside, |v| v["num_nextn_predict_layers"] = 1.into());
    let own = Model::load(&inside).unwrap();
    assert_eq!(own.config.num_nextn_predict_layers, 1);
    let mut d = MtpDrafter::load(&inside, target.clone()).unwrap();
    let h = target.config.hidden_size;
    let hidden: Vec<f32> = (0..3 * h).map(|i| (i as f32 * 0.37).sin()).collect();
    d.commit(0, Commit { start: 0, tokens: &[4, 5, 6], hidden: &hidden, next: 7 }).unwrap();
    assert_eq!(
        &d.propose(&[DraftAsk::greedy(0, 3)]).unwrap()[0].tokens,
        ds_proposal,
        "same weights, same drafts"
    );

    // A checkpoint that declares no MTP head, or whose head is not where the config says.
    let e = mtp_err(&target_dir, &target);
    assert!(e.contains("num_nextn_predict_layers"), "{e}");
    let (mimo_dir, _) = &proposals[0];
    edit_config(ds_dir, |v| v["num_hidden_layers"] = 7.into());
    let e = mtp_err(ds_dir, &target);
    assert!(
        e.contains("model.layers.7.eh_proj.weight") && e.contains("model.mtp_layers.0.input_proj.weight"),
        "{e}"
    );
    edit_config(mimo_dir, |v| v["hidden_size"] = 8.into());
    let e = mtp_err(mimo_dir, &target);
    assert!(e.contains("hidden_size") && e.contains("config.json"), "{e}");
    for dir in [&proposals[0].0, &proposals[1].0, &inside] {
        std::fs::remove_dir_all(dir).ok();
    }
}

#[test]
fn draft_model_with_another_vocabulary_is_refused() {
    let target_dir = fixture("llama-target");
    let target = Model::load(&target_dir).unwrap();
    let dir = copy_fixture("llama-draft", "vocab");
    let spec = mtp::synth::SynthSpec {
        vocab_size: 256,
        ..mtp::synth::SynthSpec::from_config(&Model::load(&dir).unwrap().config)
    };
    spec.write(&dir).unwrap();
    let e = match mtp::drafter::DraftModelDrafter::load(&dir, &target_dir, &target) {
        Ok(_) => panic!("a 256-token draft model was accepted for a 512-token target"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("vocabulary of 256") && e.contains("512") && e.contains("draft model"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_tokenizer_json_that_does_not_parse_is_an_error_naming_it() {
    let dir = copy_fixture("qwen3-draft", "badtok");
    assert!(mtp::base::Tokenizer::from_dir_if_present(&dir).unwrap().is_some());
    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let err =
        mtp::base::Tokenizer::from_dir_if_present(&dir).err().expect("a broken tokenizer.json is refused");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(mtp::base::Tokenizer::from_dir_if_present(&dir).unwrap().is_none(), "absent is not an error");
}

#[test]
fn engine_options_that_cannot_mean_anything_are_refused() {
    use mtp::engine::{Engine, EngineOptions};
    let model = Model::load(&fixture("qwen3-draft")).unwrap();
    for opts in [
        EngineOptions { max_batch: 0, ..EngineOptions::default() },
        EngineOptions { prefill_chunk: 0, ..EngineOptions::default() },
    ] {
        let err = Engine::new(&model, None, opts).err().expect("refused");
        assert!(err.to_string().contains("at least 1"), "{err}");
    }
    let mut cache = model.new_cache();
    let err = mtp::engine::prefill(&model, &mut cache, &[1, 2], 0, false, true).unwrap_err();
    assert!(err.to_string().contains("at least 1"), "{err}");
}

/// A `max_tokens` of usize::MAX reserves the whole context, not a wrapped sum: before, the
/// reservation `prompt + max_tokens + k + 1` wrapped to a few positions and a request that
/// could fill the context was admitted under a budget of half of it. Control: the same
/// request with 4 tokens fits that budget.
#[test]
fn a_huge_max_tokens_reserves_the_whole_context() {
    use mtp::engine::{Engine, EngineOptions};
    let model = Model::load(&fixture("qwen3-draft")).unwrap();
    let half = model.max_positions() / 2 * model.kv_bytes_per_token() + model.kv_bytes_per_row();
    let opts = EngineOptions { kv_budget_bytes: Some(half), ..EngineOptions::default() };
    let mut engine = Engine::new(&model, None, opts).unwrap();
    engine.submit(common::request("small", vec![1, 2], 4)).expect("4 tokens fit half the context");
    let err = engine.submit(common::request("huge", vec![1, 2], usize::MAX)).expect_err("admitted");
    assert!(err.to_string().contains("budget"), "{err}");
}

/// Removes tensors `names` from the safetensors `file` (the others' bytes packed again).
fn drop_tensors(file: &Path, names: &[&str]) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let (mut kept, mut data) = (serde_json::Map::new(), Vec::new());
    for (name, mut entry) in header {
        if names.contains(&name.as_str()) {
            continue;
        }
        if let Some(o) = entry.get("data_offsets").and_then(|o| o.as_array()) {
            let (a, b) = (o[0].as_u64().unwrap() as usize, o[1].as_u64().unwrap() as usize);
            let at = data.len();
            data.extend_from_slice(&bytes[8 + n + a..8 + n + b]);
            entry["data_offsets"] = serde_json::json!([at, data.len()]);
        }
        kept.insert(name, entry);
    }
    let header = serde_json::to_vec(&kept).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    std::fs::write(file, out).unwrap();
}

/// A tensor the config needs but the checkpoint lacks is an error naming it, in every family
/// and in Gemma 4's assistant. Control: each untouched copy loads.
#[test]
fn a_tensor_the_config_needs_but_the_file_lacks_is_named() {
    let gemma = |name: &str| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4").join(name);
    let cases = [
        (fixture("qwen3-draft"), "model.layers.0.self_attn.q_norm.weight"),
        (fixture("qwen2-draft"), "model.layers.0.self_attn.v_proj.bias"),
        (fixture("llama-draft"), "lm_head.weight"),
        (gemma("gemma4-e-target"), "model.layers.3.layer_scalar"),
        (gemma("gemma4-e-target"), "model.per_layer_projection_norm.weight"),
    ];
    for (i, (src, name)) in cases.iter().enumerate() {
        let dir = copy_dir(src, &format!("lacks-{i}"));
        Model::load(&dir).unwrap_or_else(|e| panic!("the untouched {} does not load: {e}", src.display()));
        drop_tensors(&dir.join("model.safetensors"), &[name]);
        let e = load_err(&dir);
        assert!(e.contains(&format!("missing tensor `{name}`")), "{name}: {e}");
        std::fs::remove_dir_all(dir).ok();
    }
    let target = std::sync::Arc::new(Model::load(&gemma("gemma4-e-target")).unwrap());
    let dir = copy_dir(&gemma("gemma4-e-assistant-ordered"), "lacks-assistant");
    mtp::drafter::AssistantDrafter::load(&dir, target.clone()).expect("the untouched assistant loads");
    drop_tensors(&dir.join("model.safetensors"), &["masked_embedding.token_ordering"]);
    let e = mtp::drafter::AssistantDrafter::load(&dir, target).err().expect("refused").to_string();
    assert!(e.contains("missing tensor `masked_embedding.token_ordering`"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

/// A checkpoint whose config.json describes another model is refused, naming the tensors
/// the load left unread, their file and what in config.json disagrees. Before, each of these
/// loaded silently: `num_hidden_layers: 3` on the 6-layer trained target ran 3 layers,
/// `LlamaForCausalLM` on Qwen3 weights dropped the q/k norms, `LlamaForCausalLM` on Qwen2
/// weights dropped the q/k/v biases, a tensor no architecture reads was ignored. Control:
/// each untouched copy loads, and so do tensors nobody reads by design (a vision tower, RoPE
/// `inv_freq` buffers).
#[test]
fn checkpoints_that_do_not_match_their_config_are_refused() {
    let trained = copy_dir(&common::trained("target"), "fewer-layers");
    Model::load(&trained).expect("the untouched trained target loads");
    edit_config(&trained, |v| {
        v["num_hidden_layers"] = 3.into();
        v.as_object_mut().unwrap().remove("layer_types");
    });
    let e = load_err(&trained);
    assert!(
        e.contains("`model.layers.3.")
            && e.contains("model.safetensors")
            && e.contains("num_hidden_layers 3"),
        "{e}"
    );
    assert!(e.contains("layers 3 to 5") && e.contains("tensor(s)"), "{e}");
    std::fs::remove_dir_all(trained).ok();

    let cases = [
        ("qwen3-target", "q_norm.weight", "architectures"),
        ("qwen2-target", "q_proj.bias", "attention_bias"),
        ("qwen2-draft", "k_proj.bias", "attention_bias"),
    ];
    for (name, unread, named) in cases {
        let dir = copy_fixture(name, &format!("arch-{name}"));
        Model::load(&dir).unwrap_or_else(|e| panic!("the untouched {name} does not load: {e}"));
        edit_config(&dir, |v| v["architectures"] = serde_json::json!(["LlamaForCausalLM"]));
        let e = load_err(&dir);
        assert!(e.contains(unread) && e.contains(named) && e.contains("LlamaForCausalLM"), "{name}: {e}");
        std::fs::remove_dir_all(dir).ok();
    }

    let dir = copy_fixture("llama-target", "extra");
    let file = dir.join("model.safetensors");
    add_tensors(
        &file,
        &[
            ("model.vision_tower.patch_embed.weight", &[2, 2]),
            ("multi_modal_projector.linear.weight", &[2]),
            ("model.layers.0.self_attn.rotary_emb.inv_freq", &[8]),
        ],
    );
    Model::load(&dir).expect("towers and inv_freq buffers are not the decoder's");
    add_tensors(&file, &[("model.layers.1.mlp.extra_proj.weight", &[2, 2])]);
    let e = load_err(&dir);
    assert!(e.contains("`model.layers.1.mlp.extra_proj.weight` (model.safetensors)"), "{e}");
    assert!(e.contains("1 tensor(s)") && !e.contains("vision"), "{e}");
    std::fs::remove_dir_all(dir).ok();

    // Gemma 4's assistant reads its whole checkpoint: without `use_ordered_embeddings` its
    // centroids and token ordering go unread (before, it drafted with the plain head).
    let gemma = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4");
    let target = std::sync::Arc::new(Model::load(&gemma.join("gemma4-e-target")).unwrap());
    let dir = copy_dir(&gemma.join("gemma4-e-assistant-ordered"), "assistant-unordered");
    mtp::drafter::AssistantDrafter::load(&dir, target.clone()).expect("the untouched assistant loads");
    edit_config(&dir, |v| v["use_ordered_embeddings"] = false.into());
    let e = mtp::drafter::AssistantDrafter::load(&dir, target).err().expect("refused").to_string();
    assert!(e.contains("`masked_embedding.centroids.weight`") && e.contains("assistant"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

/// `num_nextn_predict_layers` says how many MTP modules ship: 0 means no head (the target
/// loads, and loading a head says there is none; before, 0 was refused as not positive), a
/// head the config does not declare is refused by the target's load, and a count above the
/// modules shipped is refused by the head's load, naming the missing tensors (before, 2 with
/// one module was accepted). Control: the untouched trained target loads with its head.
#[test]
fn mtp_module_counts_must_match_the_checkpoint() {
    use mtp::drafter::MtpDrafter;
    let dir = copy_dir(&common::trained("target"), "nextn");
    let target = std::sync::Arc::new(Model::load(&dir).expect("the untouched trained target loads"));
    MtpDrafter::load(&dir, target.clone()).expect("its head loads");

    edit_config(&dir, |v| v["num_nextn_predict_layers"] = 2.into());
    let two = std::sync::Arc::new(Model::load(&dir).expect("the target's own tensors are all there"));
    let e = mtp_err(&dir, &two);
    assert!(e.contains("num_nextn_predict_layers") && e.contains("declares 2"), "{e}");
    assert!(e.contains("`model.mtp_layers.1.input_proj.weight`") && e.contains("more missing"), "{e}");

    edit_config(&dir, |v| v["num_nextn_predict_layers"] = 0.into());
    let e = load_err(&dir);
    assert!(e.contains("`model.mtp_layers.0.") && e.contains("num_nextn_predict_layers is 0"), "{e}");
    std::fs::remove_dir_all(dir).ok();

    let plain = copy_fixture("qwen3-draft", "nextn0");
    edit_config(&plain, |v| v["num_nextn_predict_layers"] = 0.into());
    let model = std::sync::Arc::new(Model::load(&plain).expect("0 means no MTP head"));
    assert_eq!(model.config.num_nextn_predict_layers, 0);
    let e = mtp_err(&plain, &model);
    assert!(e.contains("num_nextn_predict_layers") && e.contains("declares no MTP head"), "{e}");
    std::fs::remove_dir_all(plain).ok();
}

/// The tokenizer must fit its model: ids past `vocab_size` (a tokenizer larger than the
/// embedding) and an EOS id the tokenizer lacks are refused naming tokenizer.json and both
/// sides; a vocabulary padded above the tokenizer loads, and decoding one of its padding ids
/// is an error naming the id (before, tokenizers left it out: empty text). An EOS id outside
/// the vocabulary is refused naming the key and the file. Control: the same tokenizer over a
/// vocabulary of its own size is accepted and decodes.
#[test]
fn tokenizer_and_model_vocabularies_must_fit() {
    use mtp::synth::SynthSpec;
    let base = SynthSpec::from_config(&Config::from_dir(&fixture("qwen3-draft")).unwrap());
    let dir = std::env::temp_dir().join(format!("mtp-load-tokvocab-{}", std::process::id()));
    let with_vocab = |n: usize| {
        SynthSpec { vocab_size: n, ..base.clone() }.write(&dir).unwrap();
        Config::from_dir(&dir).unwrap()
    };
    let c = with_vocab(512);
    let tok = Tokenizer::for_model(&dir, &c).unwrap().expect("synth writes a tokenizer");
    assert!(!tok.decode(&[100, 200, 511]).unwrap().is_empty());

    // 300 embedding rows under the 512-token tokenizer the last write left.
    let c = with_vocab(300);
    Model::load(&dir).expect("the weights match the config");
    let e = Tokenizer::for_model(&dir, &c).err().expect("refused").to_string();
    assert!(e.contains("tokenizer.json") && e.contains("511") && e.contains("vocab_size is 300"), "{e}");

    // synth's own tokenizer covers its whole vocabulary (random weights pick any id)...
    let tok512 = std::fs::read(dir.join("tokenizer.json")).unwrap();
    let c = with_vocab(600);
    let tok = Tokenizer::for_model(&dir, &c).unwrap().expect("synth writes a tokenizer");
    assert_eq!(tok.decode(&[5, 550]).unwrap().matches("<synth_550>").count(), 1);
    // ...and the 512-token one over those 600 rows is a padded vocabulary.
    std::fs::write(dir.join("tokenizer.json"), &tok512).unwrap();
    let tok = Tokenizer::for_model(&dir, &c).unwrap().expect("a padded vocabulary is fine");
    let e = tok.decode(&[5, 550]).expect_err("a padding id has no text").to_string();
    assert!(e.contains("token id 550") && e.contains("tokenizer.json"), "{e}");

    edit_config(&dir, |v| v["eos_token_id"] = 550.into());
    let c = Config::from_dir(&dir).unwrap();
    let e = Tokenizer::for_model(&dir, &c).err().expect("refused").to_string();
    assert!(e.contains("tokenizer.json") && e.contains("id 550") && e.contains("eos_token_id"), "{e}");

    edit_config(&dir, |v| v["eos_token_id"] = 600.into());
    let e = load_err(&dir);
    assert!(e.contains("config.json") && e.contains("eos_token_id") && e.contains("600"), "{e}");
    edit_config(&dir, |v| v["eos_token_id"] = 0.into());
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [2, 4294967296]}"#).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("generation_config.json") && e.contains("4294967296"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}

/// One step of a path into config.json: an object key or an array index.
#[derive(Clone, Debug)]
enum Step {
    Key(String),
    At(usize),
}

/// Every key and array element under `v`, as paths (a value and all of its parts).
fn paths(v: &serde_json::Value, path: &mut Vec<Step>, out: &mut Vec<Vec<Step>>) {
    let children: Vec<(Step, &serde_json::Value)> = match v {
        serde_json::Value::Object(m) => m.iter().map(|(k, x)| (Step::Key(k.clone()), x)).collect(),
        serde_json::Value::Array(a) => a.iter().enumerate().map(|(i, x)| (Step::At(i), x)).collect(),
        _ => vec![],
    };
    for (step, x) in children {
        path.push(step);
        out.push(path.clone());
        paths(x, path, out);
        path.pop();
    }
}

fn set_at(v: &mut serde_json::Value, path: &[Step], x: serde_json::Value) {
    match path {
        [] => *v = x,
        [Step::Key(k), rest @ ..] => set_at(&mut v[k.as_str()], rest, x),
        [Step::At(i), rest @ ..] => set_at(&mut v[*i], rest, x),
    }
}

/// Values no config.json should hold.
fn hostile_values() -> Vec<serde_json::Value> {
    use serde_json::json;
    vec![
        json!(0),
        json!(-1),
        json!(0.5),
        json!(1e308),
        json!(-1e308),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(65537),
        json!(4294967296u64),
        json!("hostile"),
        serde_json::Value::Null,
        json!(true),
        json!([[1, [2]], {"a": 1}]),
        json!({"a": {"b": [1]}}),
        serde_json::Value::Array(vec![json!(7); 100_000]),
    ]
}

/// What one load (and, when it loads, a short generation) of the checkpoint in a directory
/// did: `Err` with the message of a refusal, `Ok` when it loaded and ran.
type Attempt<'a> = &'a dyn Fn() -> Result<(), String>;

/// Replaces every key and array element of `dir`'s config.json, one at a time, with each
/// hostile value, and runs `attempt`: it must load and run or refuse naming the key (the
/// last object key of the path) or the tensor whose shape disagrees, never panic. Returns
/// the failures.
fn fuzz_config(dir: &Path, attempt: Attempt) -> Vec<String> {
    let cfg = dir.join("config.json");
    let original: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let mut all = Vec::new();
    paths(&original, &mut Vec::new(), &mut all);
    let mut failures = Vec::new();
    for path in &all {
        let key = path.iter().rev().find_map(|s| if let Step::Key(k) = s { Some(k.clone()) } else { None });
        let key = key.expect("every path starts at a key");
        for x in hostile_values() {
            let mut v = original.clone();
            set_at(&mut v, path, x.clone());
            std::fs::write(&cfg, v.to_string()).unwrap();
            let shown = x.to_string().chars().take(40).collect::<String>();
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(attempt)) {
                Err(_) => failures.push(format!("{path:?} = {shown}: panicked")),
                // A size the weights disagree with may instead name the tensor and its file.
                Ok(Err(e)) if !e.contains(&key) && !e.contains("tensor") => {
                    failures.push(format!("{path:?} = {shown}: {e}"))
                }
                Ok(_) => {}
            }
        }
    }
    std::fs::write(&cfg, original.to_string()).unwrap();
    failures
}

/// A target load, then two tokens of plain decoding when it loads.
fn load_and_run(dir: &Path) -> Result<(), String> {
    let model = Model::load(dir).map_err(|e| e.to_string())?;
    let opts = mtp::engine::EngineOptions::default();
    let mut engine = mtp::engine::Engine::new(&model, None, opts).map_err(|e| format!("engine: {e}"))?;
    let out = mtp::engine::generate(&mut engine, &[request("r", vec![2, 3, 4])], &[0], |_, _| {});
    out.into_iter().next().expect("one result").map(|_| ()).map_err(|e| format!("generate: {e}"))
}

/// Hostile values in every field of config.json (0, -1, 0.5, 1e308, u64::MAX, i64::MIN,
/// strings, null, nested arrays and objects, a 100,000-element array), one field at a time,
/// for a Qwen3 target, a Gemma 4 target, Gemma 4's assistant and the trained target with its
/// MTP head: each loads (and runs two tokens) or is refused naming the key, never a panic.
/// Control: the untouched configs load and run, so the refusals come from the values.
#[test]
fn hostile_config_values_are_refused_naming_the_key() {
    let gemma = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4");
    let mut failures = Vec::new();
    for (src, tag) in [(fixture("qwen3-draft"), "fuzz-qwen3"), (gemma.join("gemma4-e-target"), "fuzz-gemma4")]
    {
        let dir = copy_dir(&src, tag);
        load_and_run(&dir).expect("the untouched config loads and runs");
        failures.extend(fuzz_config(&dir, &|| load_and_run(&dir)));
        std::fs::remove_dir_all(dir).ok();
    }

    let target = std::sync::Arc::new(Model::load(&gemma.join("gemma4-e-target")).unwrap());
    let dir = copy_dir(&gemma.join("gemma4-e-assistant"), "fuzz-assistant");
    let assistant = || -> Result<(), String> {
        let d = mtp::drafter::AssistantDrafter::load(&dir, target.clone()).map_err(|e| e.to_string())?;
        let opts = mtp::engine::EngineOptions::default();
        let mut engine =
            mtp::engine::Engine::new(&target, Some(Box::new(d)), opts).map_err(|e| e.to_string())?;
        let out = mtp::engine::generate(&mut engine, &[request("r", vec![2, 3, 4])], &[0], |_, _| {});
        out.into_iter().next().expect("one result").map(|_| ()).map_err(|e| format!("generate: {e}"))
    };
    assistant().expect("the untouched assistant loads and drafts");
    failures.extend(fuzz_config(&dir, &assistant));
    std::fs::remove_dir_all(&dir).ok();

    let dir = copy_dir(&common::trained("target"), "fuzz-trained");
    let with_head = || -> Result<(), String> {
        let model = std::sync::Arc::new(Model::load(&dir).map_err(|e| e.to_string())?);
        if model.config.num_nextn_predict_layers > 0 {
            mtp::drafter::MtpDrafter::load(&dir, model).map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    with_head().expect("the untouched trained target loads with its head");
    failures.extend(fuzz_config(&dir, &with_head));
    std::fs::remove_dir_all(&dir).ok();
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
}

/// What the fuzz above found, one case each: sizes whose products overflow or exceed any
/// model, switches the dense forward cannot honour, and ids that do not fit are refused
/// naming the key. Before: `num_attention_heads: u64::MAX` and Gemma 4's `intermediate_size:
/// u64::MAX` (double-wide) panicked on a multiplication overflow, Gemma 4's
/// `sliding_window: u64::MAX` loaded and panicked making a cache, `hidden_act: "gelu"`,
/// `mlp_bias` and `use_sliding_window` were ignored (SiLU, no biases, full attention: silently
/// another model), an EOS id of 2^64-1 was truncated to a u32, and an unknown architecture's
/// error did not name the key. Control: the untouched configs load.
#[test]
fn oversized_shapes_and_unsupported_switches_name_the_key() {
    use serde_json::json;
    let gemma = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma4/gemma4-e-target");
    let cases: [(PathBuf, &str, serde_json::Value); 11] = [
        (fixture("qwen3-draft"), "num_attention_heads", json!(u64::MAX)),
        (fixture("qwen3-draft"), "intermediate_size", json!(1u64 << 41)),
        (fixture("qwen3-draft"), "num_hidden_layers", json!(65537)),
        (fixture("qwen3-draft"), "hidden_act", json!("gelu")),
        (fixture("llama-draft"), "mlp_bias", json!(true)),
        (fixture("qwen2-draft"), "use_sliding_window", json!(true)),
        (fixture("qwen3-draft"), "eos_token_id", json!(u64::MAX)),
        (fixture("qwen3-draft"), "architectures", json!(["hostile"])),
        (gemma.clone(), "intermediate_size", json!(u64::MAX)),
        (gemma.clone(), "sliding_window", json!(u64::MAX)),
        (gemma, "vocab_size_per_layer_input", json!(1u64 << 40)),
    ];
    for (i, (src, key, value)) in cases.into_iter().enumerate() {
        let dir = copy_dir(&src, &format!("oversized-{i}"));
        load_and_run(&dir).unwrap_or_else(|e| panic!("the untouched {} does not load: {e}", src.display()));
        edit_config(&dir, |v| v[key] = value.clone());
        let e = load_err(&dir);
        assert!(e.contains(key) && e.contains("config.json"), "{key} = {value}: {e}");
        std::fs::remove_dir_all(dir).ok();
    }
}

/// `mtp synth --q-bits` writes what `mlx_lm.convert -q` writes: every matrix whose rows the
/// group divides (embedding and LM head included) packed with `scales` and `biases`, norms
/// as they are, config.json's `quantization`; the checkpoint loads and its weights lie on
/// the affine grid over [-a, a]. Control: the same spec unquantized has no `scales`.
#[test]
fn synth_writes_mlx_quantized_checkpoints() {
    use mtp::base::Checkpoint;
    use mtp::synth::{SynthQuant, SynthSpec};
    let base = SynthSpec {
        tie_word_embeddings: false,
        hidden_size: 128,
        intermediate_size: 256,
        ..SynthSpec::from_config(&Config::from_dir(&fixture("qwen3-draft")).unwrap())
    };
    let dir = std::env::temp_dir().join(format!("mtp-load-synth-q-{}", std::process::id()));
    let (h, v) = (base.hidden_size, base.vocab_size);
    for (bits, group) in [(4, 32), (8, 64)] {
        let q = SynthQuant::new(bits, group).unwrap();
        SynthSpec { quant: Some(q), ..base.clone() }.write(&dir).unwrap();
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["quantization"]["bits"], bits);
        let ck = Checkpoint::open(&dir).unwrap();
        for (name, rows) in [
            ("model.embed_tokens.weight", v),
            ("lm_head.weight", v),
            ("model.layers.0.mlp.up_proj.weight", base.intermediate_size),
        ] {
            let w = ck.get(name, &[rows, h]).unwrap();
            let quant = w.quant().unwrap_or_else(|| panic!("{name} is not quantized"));
            assert_eq!((quant.bits, quant.group), (bits, group), "{name}");
            let a = (3.0 / h as f32).sqrt();
            let mut row = vec![0.0; h];
            w.row_f32(1, &mut row);
            assert!(row.iter().all(|x| x.abs() <= a * 1.01), "{name}: {row:?}");
            let mut levels: Vec<u32> = row.iter().map(|x| x.to_bits()).collect();
            levels.sort_unstable();
            levels.dedup();
            assert!(levels.len() > 2 && levels.len() <= 1 << bits, "{name}: {} levels", levels.len());
        }
        assert!(ck.get("model.norm.weight", &[h]).unwrap().quant().is_none());
        let model = Model::load(&dir).unwrap();
        let mut cache = model.new_cache();
        mtp::engine::prefill(&model, &mut cache, &[5, 9, 11], 2, false, true).unwrap();
    }
    SynthSpec { quant: None, ..base.clone() }.write(&dir).unwrap();
    assert!(!Checkpoint::open(&dir).unwrap().contains("model.layers.0.mlp.up_proj.scales"));
    std::fs::remove_dir_all(&dir).ok();
}

/// A checkpoint file that is not a regular file is refused by name without being opened or
/// read: a FIFO named `model.safetensors` or `tokenizer.json` blocked `open()` forever, a
/// `tokenizer.json` linked to /dev/zero was read without end, a directory named
/// `model.safetensors` said only "No such device". Control: the copy with its files loads.
#[cfg(unix)]
#[test]
fn fifos_devices_and_directories_are_refused_by_name() {
    let dir = copy_fixture("qwen3-target", "special-files");
    assert!(Model::load(&dir).is_ok() && Tokenizer::from_dir(&dir).is_ok());
    // The load on a thread of its own: a regression blocks, and is reported, not hung.
    let error_of = |name: &'static str| {
        let (dir, (tx, rx)) = (dir.clone(), std::sync::mpsc::channel());
        std::thread::spawn(move || {
            let err = match name {
                "tokenizer.json" => Tokenizer::from_dir(&dir).err().map(|e| e.to_string()),
                _ => Model::load(&dir).err().map(|e| e.to_string()),
            };
            tx.send(err.unwrap_or_else(|| format!("{name}: loaded"))).ok();
        });
        rx.recv_timeout(std::time::Duration::from_secs(60)).unwrap_or_else(|_| panic!("{name}: blocked"))
    };
    for name in ["model.safetensors", "tokenizer.json"] {
        let path = dir.join(name);
        let original = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(&path).status().unwrap().success());
        let err = error_of(name);
        assert!(err.contains(name) && err.contains("not a regular file"), "FIFO {name}: {err}");
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
        let err = error_of(name);
        assert!(err.contains(name) && err.contains("not a regular file"), "/dev/zero as {name}: {err}");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let err = error_of(name);
        assert!(err.contains(name) && err.contains("a directory"), "a directory {name}: {err}");
        std::fs::remove_dir(&path).unwrap();
        std::fs::write(&path, original).unwrap();
    }
    assert!(Model::load(&dir).is_ok() && Tokenizer::from_dir(&dir).is_ok());
    std::fs::remove_dir_all(&dir).ok();
}

/// A looping or dangling link named as a checkpoint file is an error naming it: it was
/// taken for an absent file (a tokenizer.json loop: no tokenizer, text prompts refused; a
/// generation_config.json loop: its EOS ids silently lost; a model.safetensors loop: "no
/// model.safetensors in this directory"). Control: the copy with its files loads.
#[cfg(unix)]
#[test]
fn broken_links_are_errors_naming_the_file_not_absent_files() {
    let dir = copy_fixture("qwen3-target", "broken-links");
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": 3}"#).unwrap();
    assert!(Model::load(&dir).is_ok() && Tokenizer::from_dir_if_present(&dir).unwrap().is_some());
    for name in ["model.safetensors", "tokenizer.json", "generation_config.json"] {
        let path = dir.join(name);
        let original = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        for (target, says) in [(path.clone(), "symbolic links"), (dir.join("gone"), "No such file")] {
            std::os::unix::fs::symlink(&target, &path).unwrap();
            let err = match name {
                "tokenizer.json" => Tokenizer::from_dir_if_present(&dir).err().map(|e| e.to_string()),
                _ => Model::load(&dir).err().map(|e| e.to_string()),
            };
            let err = err.unwrap_or_else(|| format!("{name}: loaded as if absent"));
            assert!(err.contains(name) && err.contains(says), "{name} -> {target:?}: {err}");
            std::fs::remove_file(&path).unwrap();
        }
        std::fs::write(&path, original).unwrap();
    }
    assert!(Model::load(&dir).is_ok() && Tokenizer::from_dir_if_present(&dir).unwrap().is_some());
    std::fs::remove_dir_all(&dir).ok();
}

/// `tie_word_embeddings: true` beside a stored `lm_head.weight` (zeros here): the head is
/// the embedding, as transformers ties it; the stored one is ignored (it was used: every
/// logit 0, token 0). Control: the same checkpoint without the stored head, bit for bit.
#[test]
fn a_tied_checkpoint_ignores_a_stored_head() {
    let src = fixture("qwen3-target");
    let c = Config::from_dir(&src).unwrap();
    assert!(c.tie_word_embeddings);
    let dir = copy_fixture("qwen3-target", "tied-head");
    add_tensors(&dir.join("model.safetensors"), &[("lm_head.weight", &[c.vocab_size, c.hidden_size])]);
    let logits = |d: &Path| {
        let m = common::load(d);
        let mut cache = m.new_cache();
        let p = mtp::engine::prefill(&m, &mut cache, &[5, 9, 200], 4, false, true).unwrap();
        common::bits(&p.logits)
    };
    let want = logits(&src);
    assert!(want.iter().any(|&b| f32::from_bits(b) != 0.0));
    assert_eq!(logits(&dir), want, "the stored head was used");
    std::fs::remove_dir_all(&dir).ok();
}

/// An added token that reuses an id the vocabulary gives another token is refused naming
/// the token and the id it declares (it loaded under a fresh id, and a later check named
/// that id, which the file never names). Control: the file as shipped loads.
#[test]
fn an_added_token_reusing_an_id_is_named() {
    let dir = copy_fixture("qwen3-target", "reused-id");
    assert!(Tokenizer::from_dir(&dir).is_ok());
    let path = dir.join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = t["added_tokens"].as_array_mut().unwrap();
    let i = added.iter().position(|a| a["content"] == "<|im_end|>").unwrap();
    added[i]["id"] = serde_json::json!(100);
    std::fs::write(&path, t.to_string()).unwrap();
    let err = Tokenizer::from_dir(&dir).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json") && err.contains("`<|im_end|>` declares id 100"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// A normalizer that multiplies text (a `Replace` of `a` by 100,000 bytes) cannot turn a
/// prompt into gigabytes before the first token: a text it could grow past 256 MiB is an
/// encode error naming tokenizer.json and the growth; a short text still encodes.
/// Control: the fixture's own tokenizer encodes the same long text.
#[test]
fn a_normalizer_that_multiplies_text_is_bounded() {
    let dir = copy_dir(&common::trained("target"), "tok-growth");
    let long = "a".repeat(4096);
    let own = Tokenizer::from_dir(&dir).unwrap();
    assert!(own.encode(&long).unwrap().len() > 1, "control: the fixture's tokenizer encodes it");
    let path = dir.join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    t["normalizer"] =
        serde_json::json!({"type": "Replace", "pattern": {"String": "a"}, "content": "b".repeat(100_000)});
    std::fs::write(&path, serde_json::to_vec(&t).unwrap()).unwrap();
    let grown = Tokenizer::from_dir(&dir).unwrap();
    assert!(!grown.encode("a").unwrap().is_empty(), "a short text still encodes");
    let e = grown.encode(&long).expect_err("refused before normalizing").to_string();
    assert!(e.contains("tokenizer.json") && e.contains("100000 times") && e.contains("4096 bytes"), "{e}");
    std::fs::remove_dir_all(dir).ok();
}
