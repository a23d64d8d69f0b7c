//! Placeholder: filled in by the llama3-json syntax work.

use super::{Literal, PartialCall, Tool, ToolChoice, ToolSyntax};

pub struct Llama3Json;

impl ToolSyntax for Llama3Json {
    fn name(&self) -> &'static str {
        "llama3-json"
    }

    fn trigger(&self) -> &'static str {
        "{\"name\": "
    }

    fn grammar(&self, _: &[Tool], _: &ToolChoice, _: bool, _: Literal) -> Result<String, String> {
        Err("not yet".into())
    }

    fn calls(&self, _: &str) -> Vec<PartialCall> {
        Vec::new()
    }
}
