//! One choice's tool calls as its text grows, for `delta.tool_calls` chunks.
//!
//! Contract: fed the choice's content so far (each text extending the last), a
//! [`CallStream`] hands out content up to the trigger (never a prefix of the trigger that
//! may still complete) and, after it, each call's deltas in OpenAI's wire format: the
//! first carries the call's `index`, `id`, `type` and `function.name` with the arguments
//! so far (perhaps ""), later ones `index` and `function.arguments` only, the new text
//! (clients concatenate every string they see per index, so a repeated name or id would
//! come out repeated). One push may end a call and start the next: its deltas are in
//! index order, the first call's tail before the next call's head. Concatenated, the
//! content and each index's arguments equal what [`super::parse`] gives for the finished
//! text. The state is the choice's own.

use serde_json::{json, Value as Json};

use super::{PartialCall, ToolSyntax};
use crate::text::longest_suffix_prefix;

#[derive(Default)]
pub struct CallStream {
    /// Where the trigger starts, once it has come.
    trigger_at: Option<usize>,
    /// Bytes of content handed out.
    sent: usize,
    /// Each call whose first delta (id and name) has gone out: its name and the bytes of
    /// arguments sent.
    calls: Vec<(String, usize)>,
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
                // The call's head: all it is known by, and its arguments so far.
                deltas.push(json!({"index": k, "id": new_id(), "type": "function",
                                   "function": {"name": p.name, "arguments": p.arguments}}));
                self.calls.push((p.name.clone(), p.arguments.len()));
                continue;
            }
            let (name, sent) = &mut self.calls[k];
            // Arguments only grow by appending; anything else is held back.
            if p.name != *name || p.arguments.len() <= *sent || !p.arguments.is_char_boundary(*sent) {
                continue;
            }
            deltas.push(json!({"index": k, "function": {"arguments": &p.arguments[*sent..]}}));
            *sent = p.arguments.len();
        }
        let end = match self.trigger_at {
            // Nothing after the trigger became a call: it was text after all.
            _ if finished && self.calls.is_empty() => text.len(),
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

    /// What a client makes of the deltas, as the openai SDK assembles them: each index's
    /// strings concatenated, checking OpenAI's format on the way (the head carries `id`,
    /// `type` and `name`; later deltas `index` and `function.arguments` only).
    #[derive(Default)]
    struct Assembled {
        ids: Vec<String>,
        names: Vec<String>,
        args: Vec<String>,
    }

    impl Assembled {
        fn take(&mut self, d: &Json) {
            let k = d["index"].as_u64().unwrap() as usize;
            let f = d["function"].as_object().unwrap();
            if k == self.ids.len() {
                assert_eq!(d["type"], "function", "{d}");
                self.ids.push(d["id"].as_str().unwrap().to_string());
                self.names.push(f["name"].as_str().unwrap().to_string());
                self.args.push(String::new());
            } else {
                let mut keys: Vec<&String> = d.as_object().unwrap().keys().collect();
                keys.sort();
                assert_eq!(
                    keys,
                    ["function", "index"],
                    "a later delta carries only index and arguments: {d}"
                );
                assert_eq!(f.keys().collect::<Vec<_>>(), ["arguments"], "{d}");
                assert!(f["arguments"] != "", "an empty later delta: {d}");
            }
            self.args[k].push_str(f["arguments"].as_str().unwrap());
        }
    }

    /// Every way of cutting the text into pushes gives the content and arguments of the
    /// whole parse in OpenAI's format, each call's id given once.
    #[test]
    fn streamed_calls_equal_the_whole_parse() {
        let texts = [
            "No call here <tool_ca",
            "Let me look.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Zürich\",\"days\":2}}\n</tool_call>\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>",
            "<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"a\":{\"b\":[1,{}]}}}\n</tool_call>",
            // Cut by max_tokens inside the second call: kept as far as it came.
            "<tool_call>\n{\"name\": \"ping\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Os",
        ];
        for text in texts {
            let whole = parse(&Hermes, text);
            let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
            for step in [1, 2, 3, 7, 13, 40] {
                let mut s = CallStream::default();
                let mut ids = 0;
                let mut new_id = || {
                    ids += 1;
                    format!("call_{ids}")
                };
                let (mut content, mut got) = (String::new(), Assembled::default());
                let mut ends: Vec<usize> = cuts.iter().copied().step_by(step).collect();
                ends.push(text.len());
                for (n, &end) in ends.iter().enumerate() {
                    let (c, deltas) = s.push(&Hermes, &text[..end], n + 1 == ends.len(), &mut new_id);
                    content.push_str(&c);
                    deltas.iter().for_each(|d| got.take(d));
                }
                assert_eq!(content, whole.content, "{text:?} step {step}");
                let want: Vec<(String, String)> =
                    whole.calls.iter().map(|c| (c.name.clone(), c.arguments.clone())).collect();
                let calls: Vec<(String, String)> = got.names.into_iter().zip(got.args).collect();
                assert_eq!(calls, want, "{text:?} step {step}");
                let want_ids: Vec<String> = (1..=want.len()).map(|i| format!("call_{i}")).collect();
                assert_eq!(got.ids, want_ids, "{text:?} step {step}");
            }
        }
    }

    /// One push that ends call 0 and starts call 1 (several tokens in one step): call 0's
    /// tail, then call 1's head, then call 1's tail later, in that order.
    #[test]
    fn a_push_that_ends_one_call_and_starts_the_next() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"ping\", \"arguments\": {\"n\": 1}}\n</tool_call>";
        let cut = text.find("\"Oslo").unwrap() + 2;
        let second = text.rfind("{\"n").unwrap() + 3;
        let mut s = CallStream::default();
        let mut n = 0;
        let mut new_id = || {
            n += 1;
            format!("call_{n}")
        };
        let (_, first) = s.push(&Hermes, &text[..cut], false, &mut new_id);
        assert_eq!(
            first,
            [json!({"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": "{\"city\": \"O"}})]
        );
        let (_, both) = s.push(&Hermes, &text[..second], false, &mut new_id);
        assert_eq!(
            both,
            [
                json!({"index": 0, "function": {"arguments": "slo\"}"}}),
                json!({"index": 1, "id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{\"n"}}),
            ]
        );
        let (_, last) = s.push(&Hermes, text, true, &mut new_id);
        assert_eq!(last, [json!({"index": 1, "function": {"arguments": "\": 1}"}})]);
    }
}
