"""Grading the same outputs twice must not rewrite the committed scoreboard (`lora-lab grade` once rewrote
outputs/cpu/scoreboard.md with only a new timestamp, dirtying the tree)."""
import re

from test_grading import EVERY_COMPARATOR, FIXTURE_NOTEBOOKS, profile_dir, record_like_the_fixtures  # noqa: F401

from lora_lab.lab.grading import grade


def grade_fixtures(profile_dir):  # noqa: F811
    return grade("cpu", predictions_path=EVERY_COMPARATOR, outputs_root=profile_dir.parent,
                 notebooks_dir=FIXTURE_NOTEBOOKS)


def test_grading_twice_leaves_the_scoreboard_byte_identical(profile_dir, capsys):  # noqa: F811
    record_like_the_fixtures(profile_dir)
    grade_fixtures(profile_dir)
    markdown, png = profile_dir / "scoreboard.md", profile_dir / "scoreboard.png"
    first_md, first_png = markdown.read_bytes(), png.read_bytes()
    first_mtimes = markdown.stat().st_mtime_ns, png.stat().st_mtime_ns
    # an older timestamp in the file: only the "Generated" line would differ from a new grading
    markdown.write_bytes(re.sub(rb"Generated \S+ by", b"Generated 2000-01-01T00:00:00+00:00 by", first_md))
    older_md = markdown.read_bytes()
    assert older_md != first_md
    capsys.readouterr()
    grade_fixtures(profile_dir)
    assert markdown.read_bytes() == older_md and png.read_bytes() == first_png
    assert png.stat().st_mtime_ns == first_mtimes[1]
    assert "unchanged (same grading)" in capsys.readouterr().out


def test_a_changed_grading_rewrites_both_files(profile_dir, capsys):  # noqa: F811
    record_like_the_fixtures(profile_dir)
    grade_fixtures(profile_dir)
    markdown, png = profile_dir / "scoreboard.md", profile_dir / "scoreboard.png"
    (profile_dir / "03_records_after_failure.metrics.json").unlink()  # its predictions turn void
    png.write_bytes(b"stale")
    before = markdown.read_text()
    capsys.readouterr()
    grade_fixtures(profile_dir)
    text = markdown.read_text()
    assert text != before and "not run: no 03_records_after_failure.metrics.json" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote " in capsys.readouterr().out


def test_a_missing_png_is_drawn_again(profile_dir):  # noqa: F811
    record_like_the_fixtures(profile_dir)
    grade_fixtures(profile_dir)
    (profile_dir / "scoreboard.png").unlink()
    grade_fixtures(profile_dir)
    assert (profile_dir / "scoreboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
