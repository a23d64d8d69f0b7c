//! Chat templates: the checkpoint's own Jinja template (`chat_template.jinja`, or
//! `chat_template` in `tokenizer_config.json`), rendered with minijinja and its Python
//! string methods, as `transformers`' `apply_chat_template` renders it; message content is
//! kept from producing control tokens ([`isolate`]).

mod isolate;

use std::path::Path;

use anyhow::{bail, Context, Result};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

pub use isolate::{Piece, RenderedChat};

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
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
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("{}: cannot read", config_path.display()))?;
            serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", config_path.display()))?
        } else {
            Json::Null
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (source, from) = if jinja_path.exists() {
            let t = std::fs::read_to_string(&jinja_path)
                .with_context(|| format!("{}: cannot read", jinja_path.display()))?;
            (t, jinja_path)
        } else {
            match config.get("chat_template") {
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
                None => return Ok(None),
            }
        };
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Templates use it for "today's date" lines; a fixed date keeps prompts reproducible.
            "01 Jan 2026".to_string()
        });
        env.add_template_owned("chat", source)
            .with_context(|| format!("{}: invalid chat template", from.display()))?;
        Ok(Some(ChatTemplate {
            env,
            bos_token: token_text(config.get("bos_token")),
            eos_token: token_text(config.get("eos_token")),
        }))
    }

    /// Renders `(role, content)` messages with the generation prompt appended.
    pub fn render(&self, messages: &[(String, String)]) -> Result<String, String> {
        let messages: Vec<Value> = messages
            .iter()
            .map(|(role, content)| {
                Value::from_serialize(serde_json::json!({"role": role, "content": content}))
            })
            .collect();
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        template.render(ctx).map_err(|e| format!("chat template: {e}"))
    }
}
