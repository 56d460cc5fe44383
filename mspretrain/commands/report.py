"""Write one self-contained HTML report of a run (plots embedded) plus PNGs in RUN_DIR/report/."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from mspretrain.commands.common import existing_path, refuse_overrides
from mspretrain.errors import UserError

EXAMPLES = """examples:
  mspretrain report runs/demo
  mspretrain report runs/demo --out /tmp/demo.html

Works while the run is still going (rerun to refresh)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", metavar="FILE", help="HTML file to write (default RUN_DIR/report/report.html)")


# The start of every report render_html writes: how an earlier report is told from any other file.
_REPORT_MARK = b"<title>mspretrain report"


def _check_out(out: Path) -> None:
    """`--out` may name a new file or an earlier report, nothing else (not the run's config.toml)."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory", "name the HTML file to write, e.g. --out report.html")
    if out.exists() or out.is_symlink():
        try:
            with open(out, "rb") as f:
                head = f.read(512)
        except OSError:
            head = b""
        if _REPORT_MARK not in head:
            raise UserError(f"--out {out} exists and is not an earlier mspretrain report; refusing to replace it",
                            "name a new file (or an earlier report) with --out")


def plots_dir(run_dir: Path, out: Path | None) -> Path:
    """Where the PNGs go: RUN_DIR/report/ by default; beside --out FILE as FILE-STEM-plots/ (so
    `report --out` on a read-only run dir writes nothing into the run)."""
    return out.with_name(f"{out.stem}-plots") if out is not None else run_dir / "report"


def _write(run_dir: Path, out: Path, separate: bool, page: str, pngs: dict[str, bytes]) -> Path:
    """Write the rendered report into a hidden sibling and rename it over `out`: an interrupted report
    leaves the old one whole. `separate`: --out was given, the plots go to their own dir beside it
    (published whole, see outputs.py)."""
    from contextlib import nullcontext

    from mspretrain.forensics.report import write_pngs
    from mspretrain.outputs import OutputDir

    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        plots = OutputDir(plots_dir(run_dir, out), "report", overwrite=True) if separate else nullcontext(None)
        with plots as png_dir:
            out.parent.mkdir(parents=True, exist_ok=True)
            write_pngs(pngs, png_dir if png_dir is not None else plots_dir(run_dir, None))
            tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out)
    except OSError as exc:  # a read-only run dir (the PNGs go to RUN_DIR/report/), a full disk
        raise UserError(f"cannot write the report: {exc.strerror} ({exc.filename or out})",
                        "free space or fix permissions; --out FILE puts the HTML elsewhere") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # on a read-only filesystem even the unlink of a file never made fails (EROFS)
            pass
    return out


def run(args: argparse.Namespace) -> int:
    refuse_overrides(args, "report", "the report shows what the run recorded; rerun `mspretrain report RUN_DIR` without them")
    run_dir = existing_path(args.run_dir, "run dir", "pass the --run dir of `mspretrain train`")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is a file, not a run dir", "pass the --run dir of `mspretrain train`")
    out = Path(args.out) if args.out else run_dir / "report" / "report.html"
    _check_out(out)
    from mspretrain.forensics.report import render_report

    page, pngs = render_report(run_dir)  # every refusal comes before the first write
    if args.out:
        from mspretrain.outputs import OutputDir

        OutputDir(plots_dir(run_dir, out), "report", overwrite=True)  # refuses a plots dir of yours, writes nothing
    out = _write(run_dir, out, separate=bool(args.out), page=page, pngs=pngs)
    print(f"report: {out}")
    print(f"plots:  {plots_dir(run_dir, out if args.out else None)}/*.png")
    return 0
