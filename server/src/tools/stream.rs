//! One choice's tool calls as its text grows, for `delta.tool_calls` chunks.
//!
//! Contract: fed the choice's content so far (each text extending the last), a
//! [`CallStream`] hands out content up to the trigger (never a prefix of the trigger that
//! may still complete) and, after it, each call's deltas: the first carries the call's
//! `index`, `id`, `type` and `function.name` with the arguments so far, later ones the
//! same `index`, `id`, `type` and `name` (clients that validate every chunk need them) with
//! the new arguments text. Concatenated, the content and each call's arguments equal what
//! [`super::parse`] gives for the finished text. The state is the choice's own.

use serde_json::{json, Value as Json};

use super::{PartialCall, ToolSyntax};
use crate::text::longest_suffix_prefix;

#[derive(Default)]
pub struct CallStream {
    /// Where the trigger starts, once it has come.
    trigger_at: Option<usize>,
    /// Bytes of content handed out.
    sent: usize,
    /// Each call handed out so far: its id, name and bytes of arguments sent.
    calls: Vec<(String, String, usize)>,
    /// Calls whose first delta (id and name) has gone out.
    announced: usize,
}

impl CallStream {
    /// The content delta and the tool-call deltas for `text`, the content so far; `new_id`
    /// names a new call.
    pub fn push(
        &mut self,
        syntax: &dyn ToolSyntax,
        text: &str,
        finished: bool,
        new_id: &mut dyn FnMut() -> String,
    ) -> (String, Vec<Json>) {
        let trigger = syntax.trigger();
        if self.trigger_at.is_none() {
            self.trigger_at = text.find(trigger);
        }
        let mut deltas = Vec::new();
        let partials: Vec<PartialCall> = match self.trigger_at {
            // A stop string held back may shorten the text below the trigger for a while.
            Some(at) => text.get(at..).map(|t| syntax.calls(t)).unwrap_or_default(),
            None => Vec::new(),
        };
        for (k, p) in partials.iter().enumerate() {
            if k == self.calls.len() {
                self.calls.push((new_id(), p.name.clone(), 0));
            }
            let (id, name, sent) = &mut self.calls[k];
            // Arguments only grow by appending; anything else is held back.
            if p.name != *name || p.arguments.len() < *sent || !p.arguments.is_char_boundary(*sent) {
                continue;
            }
            let new = &p.arguments[*sent..];
            if new.is_empty() && k < self.announced {
                continue;
            }
            self.announced = self.announced.max(k + 1);
            deltas.push(json!({"index": k, "id": id, "type": "function",
                               "function": {"name": name, "arguments": new}}));
            *sent = p.arguments.len();
        }
        let end = match self.trigger_at {
            // Nothing after the trigger became a call: it was text after all.
            _ if finished && self.calls.is_empty() && !partials.iter().any(|p| p.complete) => text.len(),
            Some(at) => at.min(text.len()),
            None if finished => text.len(),
            None => text.len() - longest_suffix_prefix(text, trigger),
        };
        let content = if end > self.sent && text.is_char_boundary(self.sent) {
            let c = text[self.sent..end].to_string();
            self.sent = end;
            c
        } else {
            String::new()
        };
        (content, deltas)
    }

    /// Whether any call has been handed out.
    pub fn made_calls(&self) -> bool {
        !self.calls.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::{hermes::Hermes, parse};

    /// Every way of cutting the text into pushes gives the content and arguments of the
    /// whole parse, each call's chunks all carry its id, type and name.
    #[test]
    fn streamed_calls_equal_the_whole_parse() {
        let texts = [
            "No call here <tool_ca",
            "Let me look.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Zürich\",\"days\":2}}\n</tool_call>\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"a\":{\"b\":[1,{}]}}}\n</tool_call>",
        ];
        for text in texts {
            let whole = parse(&Hermes, text);
            let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            for step in [1, 2, 3, 7, 13] {
                let mut s = CallStream::default();
                let mut ids = 0;
                let mut new_id = || {
                    ids += 1;
                    format!("call_{ids}")
                };
                let (mut content, mut args, mut names) = (String::new(), Vec::<String>::new(), Vec::new());
                let mut announced: Vec<bool> = Vec::new();
                let mut ends: Vec<usize> = cuts.iter().copied().step_by(step).collect();
                ends.push(text.len());
                for (n, &end) in ends.iter().enumerate() {
                    let (c, deltas) = s.push(&Hermes, &text[..end], n + 1 == ends.len(), &mut new_id);
                    content.push_str(&c);
                    for d in deltas {
                        let k = d["index"].as_u64().unwrap() as usize;
                        assert_eq!(d["type"], "function");
                        assert_eq!(d["id"], format!("call_{}", k + 1), "{d}");
                        if k == args.len() {
                            args.push(String::new());
                            names.push(d["function"]["name"].as_str().unwrap().to_string());
                            announced.push(false);
                        }
                        assert_eq!(d["function"]["name"], names[k].as_str());
                        let empty = d["function"]["arguments"] == "";
                        assert!(
                            !empty || args[k].is_empty() && !std::mem::replace(&mut announced[k], true),
                            "{d}"
                        );
                        args[k].push_str(d["function"]["arguments"].as_str().unwrap());
                    }
                }
                assert_eq!(content, whole.content, "{text:?} step {step}");
                let want: Vec<(String, String)> =
                    whole.calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
                let got: Vec<(String, String)> = names.into_iter().zip(args).collect();
                assert_eq!(got, want, "{text:?} step {step}");
            }
        }
    }
}
