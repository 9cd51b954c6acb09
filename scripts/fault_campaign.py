"""A bigger kill -9 campaign than the tests run: not a test, a script whose figures go to docs/RELIABILITY.md.

    python scripts/fault_campaign.py --kills 60 --seed 0 --json            # char data, random loader
    python scripts/fault_campaign.py --kills 10 --loader sharded           # GPT-2 shards (needs ../shared/data)

The campaign itself (where the kills land, what must hold after each, the final run equal to an uninterrupted one)
is tests/campaign_tools.py's, the one tests/test_faults.py runs with a few kills; this script gives it more kills
and prints its figures (exit 0 when the final run equals the reference and nothing went wrong)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the campaign and the tests' helpers
sys.path.insert(0, str(ROOT / "src"))  # this checkout's gptforge, as in the children

from campaign_tools import SHARDED_RUN, prepare_shard_data, run_campaign, summary  # noqa: E402
from conftest import SMALL_TEXT  # noqa: E402


def prepare_char_data(folder: Path) -> Path:
    """The tests' `tiny` char-level dataset (conftest's char_data) under folder/data; returns the data_dir."""
    from gptforge.data.prepare import prepare

    folder.mkdir(parents=True, exist_ok=True)
    text_file = folder / "tiny.txt"
    text_file.write_text(SMALL_TEXT, encoding="utf-8")
    prepare("text", data_dir=str(folder / "data"), files=[str(text_file)], name="tiny", tokenizer="char")
    return folder / "data"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kills", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loader", choices=["random", "sharded"], default="random")
    p.add_argument("--max_iters", type=int, default=None, help="default 50 (random), 12 (sharded)")
    p.add_argument("--work", type=Path, default=None, help="keep the runs in this folder (default: a temp folder)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fault-campaign-") as tmp:
        work = args.work or Path(tmp)
        overrides = dict(SHARDED_RUN) if args.loader == "sharded" else {}
        if args.max_iters:
            overrides.update(max_iters=args.max_iters, lr_decay_iters=args.max_iters)
        data = prepare_shard_data(work) if args.loader == "sharded" else prepare_char_data(work)
        quiet = lambda message: print(message, file=sys.stderr)  # noqa: E731  (stdout is the JSON's)
        figures = run_campaign(
            data, work / "runs", args.kills, args.seed, log=quiet if args.json else print, **overrides
        )
    print(json.dumps(figures, indent=2) if args.json else summary(figures))
    return 0 if figures["equal"] and not figures["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
