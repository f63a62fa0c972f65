"""Render a sweep's report.html to one PNG, as a browser window of a given width would show the whole page.

    python3 tools/render_report.py sweep/report.html [-o report.png] [--width 1200] [--scale 1.5]

No headless browser ships in a pip package that installs without a download of its own, so the page
goes through WeasyPrint (HTML/CSS to PDF, on the system's Pango) and PDFium (PDF to bitmap, from the
``pypdfium2`` wheel): ``pip install weasyprint pypdfium2``. Neither is a graphserve dependency; the
tool says so when they are missing. The page is laid out on one sheet as wide as the window and tall
enough for everything, so the PNG is the page a reader scrolls through rather than print pages; the
blank rest of the sheet is cut off. Folded ``<details>`` stay folded, as a browser opens the page
(WeasyPrint would print them open).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# A sheet taller than any report: the PNG is cropped to the content afterwards. PDF user units are
# 1/72 in and CSS px are 1/96 in; PDFium renders at 72 dpi times --scale.
SHEET_HEIGHT_PX = 40000
SCREEN_CSS = """
@page {{ size: {width}px {height}px; margin: 0 }}
html {{ background: #fff }}
body {{ margin-top: 24px; margin-bottom: 24px }}
details:not([open]) > :not(summary) {{ display: none }}
summary {{ display: block }}
summary::before {{ content: "\\25B8  " }}
"""


def _import_renderers():
    try:
        import pypdfium2
        import weasyprint
    except ImportError as exc:
        raise SystemExit(f"render_report needs weasyprint and pypdfium2 ({exc}): pip install weasyprint pypdfium2 "
                         "(into any folder on PYTHONPATH; graphserve itself does not need them)") from None
    return weasyprint, pypdfium2


def html_to_pdf(html_path: Path, width_px: int) -> bytes:
    weasyprint, _ = _import_renderers()
    css = weasyprint.CSS(string=SCREEN_CSS.format(width=width_px, height=SHEET_HEIGHT_PX))
    return weasyprint.HTML(filename=str(html_path)).write_pdf(stylesheets=[css])


def pdf_to_png(pdf: bytes, out_path: Path, scale: float) -> tuple[int, int]:
    """First sheet of ``pdf`` to ``out_path``, cut below the last non-white row; returns (width, height)."""
    _, pypdfium2 = _import_renderers()
    from PIL import ImageChops

    doc = pypdfium2.PdfDocument(pdf)
    if len(doc) != 1:  # the sheet was too short: a second one would be lost
        raise SystemExit(f"the page needs {len(doc)} sheets of {SHEET_HEIGHT_PX}px; raise SHEET_HEIGHT_PX")
    image = doc[0].render(scale=scale).to_pil().convert("RGB")
    blank = image.copy()
    blank.paste((255, 255, 255), (0, 0, *image.size))
    box = ImageChops.difference(image, blank).getbbox()
    if box is None:
        raise SystemExit("the rendered page is blank")
    margin = int(24 * scale)
    image = image.crop((0, 0, image.width, min(image.height, box[3] + margin)))
    image.save(out_path, optimize=True)
    return image.size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("html", type=Path, help="a report.html written by graphserve sweep / graphserve report")
    p.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: beside the HTML, .png)")
    p.add_argument("--width", type=int, default=1200, help="window width in CSS px")
    p.add_argument("--scale", type=float, default=1.5, help="pixels per PDF point (1.5 ≈ a 2x screen at 1200px)")
    args = p.parse_args(argv)
    if not args.html.is_file():
        raise SystemExit(f"html={args.html} is invalid: no such file")
    if not 320 <= args.width <= 4000:
        raise SystemExit(f"width={args.width} is invalid: must be between 320 and 4000 px")
    if not 0.25 <= args.scale <= 4:
        raise SystemExit(f"scale={args.scale} is invalid: must be between 0.25 and 4")
    out = args.output or args.html.with_suffix(".png")
    size = pdf_to_png(html_to_pdf(args.html, args.width), out, args.scale)
    print(f"wrote {out} ({size[0]}x{size[1]} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
