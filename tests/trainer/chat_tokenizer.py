"""A Qwen2.5-style chat tokenizer built offline: tool-calling chat template + special tokens.

The template is written here from Qwen's documented function-calling format (Hermes style, as
rendered by Qwen2.5-Instruct): a system turn listing the tools' JSON schemas inside
``<tools></tools>``, turns ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, an assistant
message's ``tool_calls`` as ``\\n<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``,
and consecutive ``role: "tool"`` messages as one ``user`` turn of ``\\n<tool_response>\\n{content}
\\n</tool_response>`` blocks. ``<|im_start|>`` / ``<|im_end|>`` are special tokens (``<|im_end|>`` is
EOS), ``<tool_call>`` / ``</tool_call>`` added non-special tokens, as in Qwen2.5's tokenizer.
"""

from __future__ import annotations

import copy

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast

from trainer.models.tiny import build_byte_tokenizer

QWEN25_STYLE_TEMPLATE = r"""
{%- if messages and messages[0].role == 'system' -%}
  {%- set system = messages[0].content -%}
{%- else -%}
  {%- set system = 'You are a helpful assistant.' -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system -}}
{%- if tools -%}
  {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
  {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
  {%- for tool in tools -%}
    {{- '\n' + (tool | tojson) -}}
  {%- endfor -%}
  {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments ' -}}
  {{- 'within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
  {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages -%}
  {%- if message.role == 'system' and loop.first -%}
  {%- elif message.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
      {{- '<|im_start|>user' -}}
    {%- endif -%}
    {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
      {{- '<|im_end|>\n' -}}
    {%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\n' + (message.content or '') -}}
    {%- for call in message.tool_calls or [] -%}
      {%- set fn = call.function if call.function is defined else call -%}
      {%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
      {{- '\n<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + args + '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def chat_tokenizer(base: PreTrainedTokenizerFast | None = None) -> PreTrainedTokenizerFast:
    """A copy of ``base`` (default: the tiny byte-level tokenizer) made Qwen2.5-like.

    Adds the special tokens ``<|im_start|>``, ``<|im_end|>`` (the EOS), the non-special added
    tokens ``<tool_call>``, ``</tool_call>``, and :data:`QWEN25_STYLE_TEMPLATE`.
    """
    tok = copy.deepcopy(base) if base is not None else build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")])
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25_STYLE_TEMPLATE
    return tok
