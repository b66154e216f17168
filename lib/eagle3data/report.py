"""HTML rendering: executed notebooks as HTML, and the run's shareable `report.html`.

The report is the executed 03_audit notebook rendered without code cells: images are
embedded (nbconvert's HTML exporter inlines PNG outputs), so the file stands alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

EXTERNAL_SCRIPT = re.compile(r"<script[^>]*\bsrc=\"https?://[^\"]*\"[^>]*>\s*</script>", re.I)
SECRET_KEY = re.compile(r"(api_?key|secret|token|password|authorization)(?!_env)", re.I)


def notebook_to_html(nb_path: str | Path, html_path: str | Path, *, exclude_input: bool = False) -> Path:
    """Render an executed notebook to a self-contained HTML file."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(nb_path), as_version=4)
    exporter = HTMLExporter(exclude_input=exclude_input, exclude_input_prompt=exclude_input,
                            exclude_output_prompt=exclude_input)
    body, _ = exporter.from_notebook_node(nb)
    Path(html_path).write_text(body, encoding="utf-8")
    return Path(html_path)


def render_report(run_dir: str | Path) -> Path:
    """`<run>/report.html` from the executed 03_audit notebook, code cells hidden."""
    run_dir = Path(run_dir)
    src = run_dir / "notebooks" / "03_audit.ipynb"
    if not src.exists():
        raise FileNotFoundError(f"no executed audit notebook at {src}: run stage 03 first")
    out = notebook_to_html(src, run_dir / "report.html", exclude_input=True)
    text = out.read_text(encoding="utf-8")
    # self-contained: drop the template's CDN scripts (require.js, MathJax); the report needs neither
    text = EXTERNAL_SCRIPT.sub("", text)
    out.write_text(text, encoding="utf-8")
    return out


def redact(obj: Any) -> Any:
    """Params as plain data with any secret-looking value replaced (params hold none by design)."""
    if isinstance(obj, dict):
        return {k: ("***" if SECRET_KEY.search(str(k)) and not str(k).endswith("_env") and isinstance(v, str)
                    else redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return obj


class HTMLBlock:
    """A piece of HTML that Jupyter (and so the report) displays as is."""

    def __init__(self, html: str):
        self.html = html

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:  # the text/plain twin of the HTML: stable, so nbval compares only the HTML
        return "<HTML block>"


def show_table(df: Any, css_class: str = "audit-table", *, caption: str | None = None) -> HTMLBlock:
    """A DataFrame as an HTML table with a CSS class (the report's check table is `check-table`)."""
    if df is None or len(df) == 0:
        return HTMLBlock(f"<p><i>{caption or 'table'}: nothing to show</i></p>")
    body = df.to_html(classes=css_class, na_rep="", float_format=lambda x: f"{x:.4g}", border=0)
    cap = f"<p><b>{caption}</b></p>" if caption else ""
    return HTMLBlock(cap + body)


def params_html(params: Any) -> HTMLBlock:
    """The run's params as an indented YAML block (secrets redacted)."""
    import html

    import yaml

    from .params import params_for_display

    text = yaml.safe_dump(redact(params_for_display(params)), sort_keys=False, allow_unicode=True)
    return HTMLBlock(f'<pre style="font-size:12px;background:#f6f8fa;padding:6px;max-height:22em;overflow:auto">{html.escape(text)}</pre>')
