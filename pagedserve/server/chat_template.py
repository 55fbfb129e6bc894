"""``serve --chat-template``: a Jinja chat template that replaces the tokenizer's own.

The value is a path to a template file, or the template itself (anything with ``{{`` or
``{%`` in it). It is compiled once at startup, in the environment chat templates are rendered in
(:func:`pagedserve.chat_templates.template_environment`), so a template that cannot compile stops
the server before the model loads, with one line naming the problem, instead of failing every
chat request.
"""

from __future__ import annotations

from pathlib import Path

MAX_TEMPLATE_BYTES = 1 << 20  # far above any real template; keeps a wrong path (a model file) out


def load_chat_template(value: str) -> str:
    """The template text of ``--chat-template VALUE``, checked to compile; ValueError otherwise."""
    import jinja2

    from pagedserve.chat_templates import template_environment

    path = Path(value).expanduser()
    looks_inline = "{{" in value or "{%" in value
    if not looks_inline:
        if not path.is_file():
            raise ValueError(f"--chat-template {value!r}: no such file, and not an inline Jinja template "
                             "(which contains '{{' or '{%')")
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"--chat-template {value}: {path.stat().st_size} bytes is not a chat template "
                             f"(at most {MAX_TEMPLATE_BYTES} bytes)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"--chat-template {value}: not UTF-8 text ({exc.reason})") from None
    else:
        text = value
    try:
        template_environment().from_string(text)  # compiles: unknown filters and tests fail here too
    except jinja2.TemplateSyntaxError as exc:
        where = f"{value}:{exc.lineno}" if not looks_inline else f"line {exc.lineno}"
        raise ValueError(f"--chat-template does not compile ({where}): {exc.message}") from None
    return text
