//! Placeholder: filled in by the gemma4 syntax work.

use super::{Literal, PartialCall, Tool, ToolChoice, ToolSyntax};

pub struct Gemma4;

impl ToolSyntax for Gemma4 {
    fn name(&self) -> &'static str {
        "gemma4"
    }

    fn trigger(&self) -> &'static str {
        "<|tool_call>"
    }

    fn grammar(&self, _: &[Tool], _: &ToolChoice, _: bool, _: Literal) -> Result<String, String> {
        Err("not yet".into())
    }

    fn calls(&self, _: &str) -> Vec<PartialCall> {
        Vec::new()
    }
}
