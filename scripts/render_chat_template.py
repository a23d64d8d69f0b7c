#!/usr/bin/env python3
"""Renders a chat template the way transformers' `apply_chat_template` does (a sandboxed
Jinja2 environment with trim_blocks and lstrip_blocks, loop controls, `tojson` as
`json.dumps(ensure_ascii=False)`, `raise_exception`), for tests/chat_templates.rs to compare
with the server's own renderer. Reads a JSON list of {"messages", "tools"} and prints one
JSON string per conversation.

    python scripts/render_chat_template.py TEMPLATE CONVERSATIONS.json BOS EOS [--jinja-tojson]

`--jinja-tojson` keeps Jinja2's own `tojson` (HTML-safe, sorted keys) instead of
transformers': the tests' negative control.
"""

import json
import sys

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise ValueError(message)


def main():
    template, conversations, bos, eos = sys.argv[1:5]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    if "--jinja-tojson" not in sys.argv[5:]:
        env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    with open(template, encoding="utf-8") as f:
        compiled = env.from_string(f.read())
    with open(conversations, encoding="utf-8") as f:
        for conv in json.load(f):
            text = compiled.render(messages=conv["messages"], tools=conv.get("tools") or None,
                                   add_generation_prompt=True, bos_token=bos, eos_token=eos)
            print(json.dumps(text))


if __name__ == "__main__":
    main()
