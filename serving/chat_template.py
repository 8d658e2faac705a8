"""A chat template given in the configuration (AppConfig.chat_template, `--chat-template`): read
and checked where the config is validated, so its text travels in the config."""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def chat_template_text(value: str) -> str:
    """A chat template's text from `value`, the text itself (it has {{ or {%) or its file's path;
    ValueError where the file does not read or the template does not parse (AppConfig.chat_template,
    `pdserve generate --chat-template`)."""
    if "{{" in value or "{%" in value:
        text = value
    else:
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"neither a template (no {{{{ or {{%) nor a file that reads: {value}: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    try:        # as transformers compiles it (loop controls on); filters are checked when it renders
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the template does not parse: line {exc.lineno}: {exc.message}") from None
    return text
