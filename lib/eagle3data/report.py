"""HTML rendering: executed notebooks as HTML, and the run's shareable `report.html`.

The report is the executed 03_audit notebook rendered without code cells: images are
embedded (nbconvert's HTML exporter inlines PNG outputs), so the file stands alone.
"""

from __future__ import annotations

from pathlib import Path


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
    return notebook_to_html(src, run_dir / "report.html", exclude_input=True)
