//! The server renders chat templates as transformers' `apply_chat_template` does: the
//! committed templates (the trained family's, with and without tools; the Gemma 4-format
//! test template) give byte-identical prompts under the server's minijinja renderer and
//! under Jinja2 configured as transformers configures it (`scripts/render_chat_template.py`;
//! Jinja2 is installed by `.ci/run`), over conversations with system turns, multi-line
//! content, non-ASCII text, tools, assistant calls and tool results. **Negative control**:
//! Jinja2 with its own `tojson` (HTML-safe, sorted keys) in place of transformers' renders
//! the trained family's tool prompts differently (asserted), so the comparison can fail.

mod common;

use std::path::{Path, PathBuf};

use mtp::server::chat::{ChatTemplate, Conversation};
use serde_json::{json, Value};

fn conversations() -> Vec<Value> {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather <now>, \"quoted\"",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "a_days": {"type": "integer"}},
                        "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}}}}
    ]);
    vec![
        json!({"messages": [{"role": "user", "content": "hi there"}]}),
        json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "fn main() {}"}, {"role": "user", "content": "more\nlines"}]}),
        json!({"messages": [{"role": "user", "content": "weather in Zürich? 天气"}], "tools": tools}),
        json!({"messages": [{"role": "user", "content": "time?"},
                            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                              "function": {"name": "get_time", "arguments": {"zone": "cet", "b": [1, true, null, 2.5]}}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "14:05\nCET"}], "tools": tools}),
    ]
}

fn render_ours(template: &ChatTemplate) -> Vec<String> {
    conversations()
        .iter()
        .map(|c| {
            let tools = c.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
            let chat = Conversation {
                messages: c["messages"].as_array().unwrap().clone(),
                tools,
                ..Conversation::default()
            };
            template.render(&chat).unwrap()
        })
        .collect()
}

/// Jinja2's rendering as transformers sets it up, or `None` when no Python with Jinja2.
fn render_jinja2(template: &Path, jinja_tojson: bool) -> Option<Vec<String>> {
    let python = common::python_with("jinja2")?;
    let convs = std::env::temp_dir().join(format!("mtp-chat-templates-{}.json", std::process::id()));
    std::fs::write(&convs, serde_json::to_string(&conversations()).unwrap()).unwrap();
    let (template, convs) = (template.to_str().unwrap(), convs.to_str().unwrap());
    let mut args = vec![template, convs, "<bos>", "<eos>"];
    args.extend(jinja_tojson.then_some("--jinja-tojson"));
    Some(common::script_lines(&python, "render_chat_template.py", &args))
}

fn templates() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    vec![root.join("trained/target/chat_template.jinja"), root.join("chat-templates/gemma4-tools.jinja")]
}

#[test]
fn committed_templates_render_as_transformers_renders_them() {
    for path in templates() {
        let Some(want) = render_jinja2(&path, false) else { return };
        let source = std::fs::read_to_string(&path).unwrap();
        let ours = ChatTemplate::from_source(source.clone(), "<bos>".into(), "<eos>".into()).unwrap();
        assert_eq!(render_ours(&ours), want, "{}", path.display());
        if path.ends_with("trained/target/chat_template.jinja") {
            let control = render_jinja2(&path, true).unwrap();
            assert_ne!(render_ours(&ours), control, "the comparison cannot see another tojson");
        }
    }
}
