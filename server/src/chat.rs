//! Chat templates: the checkpoint's own Jinja template (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`), rendered with minijinja and its Python
//! string methods, as `transformers`' `apply_chat_template` renders it; message content is
//! kept from producing control tokens ([`isolate`]).

mod isolate;

use std::path::Path;

use anyhow::{bail, Context, Result};
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::ser::{Formatter, PrettyFormatter};
use serde_json::Value as Json;

pub use isolate::{Piece, RenderedChat};

/// What a chat template renders: the messages (transformers' shape, see
/// [`crate::api::Message::read`]) and the request's tools as given (`{"type": "function",
/// "function": {...}}`).
#[derive(Clone, Debug, Default)]
pub struct Conversation {
    pub messages: Vec<Json>,
    pub tools: Vec<Json>,
    /// Extra template variables (`chat_template_kwargs`), by name.
    pub kwargs: serde_json::Map<String, Json>,
}

/// Variables the server sets itself: a `chat_template_kwargs` key may not name them.
const RESERVED: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

impl Conversation {
    /// Every string the conversation holds (content, names, arguments, descriptions).
    pub fn strings(&self) -> Vec<&str> {
        fn walk<'a>(v: &'a Json, out: &mut Vec<&'a str>) {
            match v {
                Json::String(s) => out.push(s),
                Json::Array(a) => a.iter().for_each(|v| walk(v, out)),
                Json::Object(o) => o.iter().for_each(|(k, v)| {
                    out.push(k);
                    walk(v, out)
                }),
                _ => {}
            }
        }
        let mut out = Vec::new();
        self.messages.iter().chain(&self.tools).chain(self.kwargs.values()).for_each(|v| walk(v, &mut out));
        out
    }

    /// `chat_template_kwargs` as the template's variables: an object whose keys are names
    /// (letters, digits, `_`, not a digit first) other than the server's own; else a
    /// refusal naming the key.
    pub fn kwargs(v: Option<&Json>) -> Result<serde_json::Map<String, Json>, (String, String)> {
        let map = match v {
            None | Some(Json::Null) => return Ok(Default::default()),
            Some(Json::Object(m)) => m,
            Some(_) => {
                return Err(("chat_template_kwargs".into(), "must be an object of template variables".into()))
            }
        };
        for k in map.keys() {
            let name = !k.is_empty()
                && !k.starts_with(|c: char| c.is_ascii_digit())
                && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            let at = format!("chat_template_kwargs.{k}");
            if !name {
                return Err((at, "a template variable's name is letters, digits and `_`".into()));
            }
            if RESERVED.contains(&k.as_str()) {
                return Err((at, format!("`{k}` is set by the server (from the request's own fields)")));
            }
        }
        Ok(map.clone())
    }

    /// The conversation with `f` applied to every string, values and keys alike: a
    /// template may print a mapping's keys (`tojson`, iterating a tool's properties), so a
    /// key is text the model reads too.
    pub fn map_strings(&self, f: &dyn Fn(&str) -> String) -> Conversation {
        fn walk(v: &Json, f: &dyn Fn(&str) -> String) -> Json {
            match v {
                Json::String(s) => Json::String(f(s)),
                Json::Array(a) => Json::Array(a.iter().map(|v| walk(v, f)).collect()),
                Json::Object(o) => Json::Object(o.iter().map(|(k, v)| (f(k), walk(v, f))).collect()),
                other => other.clone(),
            }
        }
        Conversation {
            messages: self.messages.iter().map(|v| walk(v, f)).collect(),
            tools: self.tools.iter().map(|v| walk(v, f)).collect(),
            // Values only: the keys are the template's variable names.
            kwargs: self.kwargs.iter().map(|(k, v)| (k.clone(), walk(v, f))).collect(),
        }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template's text (its markup tells the tool-call and reasoning syntax).
    source: String,
    bos_token: String,
    eos_token: String,
}

/// `tojson` as transformers defines it for templates: Python's `json.dumps` with
/// `ensure_ascii=False` (`", "` and `": "` between items, or `indent` spaces per level),
/// keys in the order given (`sort_keys` sorts them), no HTML escaping (minijinja's own
/// filter is compact and escapes `<`, which would change every tool prompt).
fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut json =
        serde_json::to_value(&v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    if sort_keys == Some(true) {
        json.sort_all_objects();
    }
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser =
                serde_json::Serializer::with_formatter(&mut out, PrettyFormatter::with_indent(&pad));
            json.serialize(&mut ser)
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(&mut out, Spaced)),
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(String::from_utf8(out).expect("serde_json writes UTF-8")))
}

/// Python's default JSON separators.
struct Spaced;

impl Formatter for Spaced {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(w, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(w, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `", "` before every item but the first.
fn item_separator<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        w.write_all(b", ")
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&Json>) -> String {
    match v {
        Some(Json::String(s)) => s.clone(),
        Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of checkpoint `dir`, or `None` when it has none. A template that is
    /// there but unreadable or not valid Jinja is an error naming the file.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        ChatTemplate::load(dir, None)
    }

    /// The template in file `file` (`--chat-template`) with checkpoint `dir`'s BOS and EOS
    /// texts; an error names the file.
    pub fn from_file(file: &Path, dir: &Path) -> Result<ChatTemplate> {
        ChatTemplate::load(dir, Some(file))?.with_context(|| format!("{}: no template", file.display()))
    }

    fn load(dir: &Path, file: Option<&Path>) -> Result<Option<ChatTemplate>> {
        // A GGUF keeps these keys in its metadata.
        let gguf = mtp_base::gguf::is_gguf(dir);
        let config_path = if gguf { dir.to_path_buf() } else { dir.join("tokenizer_config.json") };
        let config: Json = if gguf {
            mtp_base::gguf::tokenizer_config(dir)?
        } else if mtp_base::files::present(&config_path) {
            mtp_base::config::read_json(&config_path)?
        } else {
            Json::Null
        };
        let jinja_path = file.map_or_else(|| dir.join("chat_template.jinja"), Path::to_path_buf);
        let (source, from) = if file.is_some() || mtp_base::files::present(&jinja_path) {
            // A template is text of a JSON file's size at most (a FIFO or device refused).
            let bytes = mtp_base::files::read_bounded(&jinja_path, mtp_base::files::MAX_JSON_BYTES)?;
            let t = String::from_utf8(bytes)
                .with_context(|| format!("{}: cannot read: not UTF-8", jinja_path.display()))?;
            (t, jinja_path)
        } else {
            match config.get("chat_template") {
                // As transformers: a null or empty template is no template.
                None | Some(Json::Null) => return Ok(None),
                Some(Json::String(s)) if s.trim().is_empty() => {
                    tracing::warn!("{}: `chat_template` is empty: no template", config_path.display());
                    return Ok(None);
                }
                Some(Json::String(s)) => (s.clone(), config_path.clone()),
                // A list of named templates: the one called `default`.
                Some(Json::Array(list)) => {
                    let default =
                        list.iter().find(|t| t.get("name").and_then(Json::as_str) == Some("default"));
                    match default.and_then(|t| t.get("template")).and_then(Json::as_str) {
                        Some(s) => (s.to_string(), config_path.clone()),
                        None => bail!(
                            "{}: `chat_template` lists no template named `default`",
                            config_path.display()
                        ),
                    }
                }
                Some(_) => bail!("{}: `chat_template` is neither a string nor a list", config_path.display()),
            }
        };
        if source.trim().is_empty() {
            // `--chat-template` names the file on purpose; a checkpoint's empty file is none.
            if file.is_some() {
                bail!("{}: the chat template is empty", from.display());
            }
            tracing::warn!("{}: empty: no chat template", from.display());
            return Ok(None);
        }
        let template = ChatTemplate::from_source(
            source,
            token_text(config.get("bos_token")),
            token_text(config.get("eos_token")),
        )
        .map_err(|e| anyhow::anyhow!("{}: invalid chat template: {e}", from.display()))?;
        Ok(Some(template))
    }

    /// A template from its text, with the tokenizer's BOS and EOS texts.
    pub fn from_source(source: String, bos_token: String, eos_token: String) -> Result<ChatTemplate, Error> {
        let mut env = Environment::new();
        // As transformers' environment: a block tag's own newline and indentation vanish.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // A render is bounded in work as its output is in bytes (`render`).
        env.set_fuel(Some(RENDER_FUEL));
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it for "today's date" lines; a fixed date keeps prompts reproducible.
            "01 Jan 2026".to_string()
        });
        env.add_template_owned("chat", source.clone())?;
        Ok(ChatTemplate { env, source, bos_token, eos_token })
    }

    /// `tokenizer_config.json`'s keys for the BOS and EOS texts the template writes, each
    /// with its text (empty when the file names none).
    pub fn special_texts(&self) -> [(&'static str, &str); 2] {
        [("bos_token", &self.bos_token), ("eos_token", &self.eos_token)]
    }

    /// The template's text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation with the generation prompt appended.
    pub fn render(&self, chat: &Conversation) -> Result<String, String> {
        let messages: Vec<Value> = chat.messages.iter().map(Value::from_serialize).collect();
        // Templates test `if tools`: no tools is none, as transformers passes it.
        let tools = if chat.tools.is_empty() { Value::from(()) } else { Value::from_serialize(&chat.tools) };
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            ..Value::from_serialize(&chat.kwargs)
        };
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let mut out = Capped { text: Vec::new(), over: false };
        match template.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.text).map_err(|e| format!("chat template: {e}")),
            Err(_) if out.over => Err(format!(
                "the chat template's output for these messages passed {} MiB",
                RENDERED_BYTES >> 20
            )),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(format!(
                "the chat template ran past its budget of {RENDER_FUEL} steps for these messages"
            )),
            Err(e) => Err(format!("chat template: {e}")),
        }
    }
}

/// The most a render may write: far past any context's worth of text.
const RENDERED_BYTES: usize = 32 << 20;
/// The most template instructions a render may run (a second or so): real templates take
/// thousands a message.
const RENDER_FUEL: u64 = 50_000_000;

/// A render's output, refused past [`RENDERED_BYTES`].
struct Capped {
    text: Vec<u8>,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len().saturating_add(buf.len()) > RENDERED_BYTES {
            self.over = true;
            return Err(std::io::Error::other("the rendered chat is too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, content: &str) -> Result<String, String> {
        let t = ChatTemplate::from_source(source.into(), "<s>".into(), "</s>".into()).unwrap();
        let chat = Conversation {
            messages: vec![serde_json::json!({"role": "user", "content": content})],
            ..Conversation::default()
        };
        t.render(&chat)
    }

    /// `chat_template_kwargs` reach the template as variables (Qwen3's switch); names the
    /// server sets, and names that are no identifiers, are refused by key. Control: without
    /// them the template's default holds.
    #[test]
    fn template_kwargs_are_variables_and_cannot_replace_the_servers() {
        let source = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}{{ messages[0].content }}";
        let t = ChatTemplate::from_source(source.into(), "<s>".into(), "</s>".into()).unwrap();
        let chat = |kwargs: Option<Json>| Conversation {
            messages: vec![serde_json::json!({"role": "user", "content": "hi"})],
            kwargs: Conversation::kwargs(kwargs.as_ref()).unwrap(),
            ..Conversation::default()
        };
        assert_eq!(
            t.render(&chat(Some(serde_json::json!({"enable_thinking": false})))).unwrap(),
            "NOTHINK hi"
        );
        assert_eq!(t.render(&chat(None)).unwrap(), "hi");
        for (bad, at) in [
            (serde_json::json!({"messages": []}), "chat_template_kwargs.messages"),
            (
                serde_json::json!({"add_generation_prompt": false}),
                "chat_template_kwargs.add_generation_prompt",
            ),
            (serde_json::json!({"a-b": 1}), "chat_template_kwargs.a-b"),
            (serde_json::json!({"1x": 1}), "chat_template_kwargs.1x"),
            (serde_json::json!([1]), "chat_template_kwargs"),
        ] {
            assert_eq!(Conversation::kwargs(Some(&bad)).unwrap_err().0, at, "{bad}");
        }
    }

    /// A render is bounded in output and in work, each refusal naming which; the same
    /// templates within the bounds render (the controls).
    #[test]
    fn renders_are_bounded_in_bytes_and_steps() {
        let repeat =
            |n: usize| format!("{{% for i in range({n}) %}}{{{{ messages[0].content }}}}{{% endfor %}}");
        let kib = "x".repeat(1024);
        let e = render(&repeat(40_000), &kib).unwrap_err();
        assert!(e.contains("passed 32 MiB"), "{e}");
        assert_eq!(render(&repeat(10), &kib).unwrap().len(), 10 * 1024);
        let spin = |n: usize| {
            format!("{{% for i in range({n}) %}}{{% for j in range({n}) %}}{{% endfor %}}{{% endfor %}}ok")
        };
        let e = render(&spin(20_000), "").unwrap_err();
        assert!(e.contains("budget of 50000000 steps"), "{e}");
        assert_eq!(render(&spin(100), "").unwrap(), "ok");
    }
}
