"""verify: a published notebook holds the code cells its run executed; known-stale runs are listed, shrink-only."""
import json

from test_verify import Repo

from lora_lab.lab.provenance import notebook_hash
from lora_lab.lab.verify import STALE_RUNS, verify


def _notebook(code: str, prose: str = "# demo") -> str:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": prose},
             {"cell_type": "code", "metadata": {}, "source": code, "outputs": [], "execution_count": 1}]
    return json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


def _publish(repo: Repo, notebook: str, code: str) -> str:
    """Commit notebooks/<notebook>.ipynb, then publish a run of that commit under outputs/cpu/."""
    repo.write(f"notebooks/{notebook}.ipynb", _notebook(code))
    ran = repo.commit(f"{notebook}: code")
    repo.write(f"outputs/cpu/{notebook}.ipynb", _notebook(code))
    provenance = {"status": "completed", "git_commit": ran,
                  "notebook_hash": notebook_hash(repo.root / "notebooks" / f"{notebook}.ipynb")}
    repo.write(f"outputs/cpu/{notebook}.metrics.json",
               json.dumps({"notebook": notebook, "profile": "cpu", "metrics": {}, "provenance": provenance}))
    repo.commit(f"{notebook}: published run")
    return ran


def _stale(*entries: tuple[str, str]) -> str:
    return "".join(f"- profile: cpu\n  notebook: {notebook}\n  git_commit: {commit}\n  why: edited after the run\n"
                   for notebook, commit in entries) or "[]\n"


def test_a_published_notebook_whose_code_cells_changed_after_its_run_fails(tmp_path):
    repo = Repo(tmp_path / "repo")
    repo.predictions()
    ran = _publish(repo, "01_demo", "x = 1")
    assert verify(repo.root).ok
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("x = 1", prose="# demo, a corrected figure"))
    repo.commit("prose only")
    assert verify(repo.root).ok  # markdown may change after a run
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("y = 1"))
    repo.commit("a code cell renamed after the run")
    report = verify(repo.root)
    assert report.violations == [
        f"outputs/cpu/01_demo.ipynb: code cells differ from the run (of {ran[:7]}); republish needed"]

    repo.write(STALE_RUNS, _stale(("01_demo", ran)))
    repo.commit("the known-stale list")
    report = verify(repo.root)
    assert report.ok and any("known stale" in note and "01_demo" in note for note in report.notes)


def test_the_known_stale_list_only_shrinks_and_a_new_mismatch_fails(tmp_path):
    repo = Repo(tmp_path / "repo")
    repo.predictions()
    first = _publish(repo, "01_demo", "x = 1")
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("y = 1"))
    repo.write(STALE_RUNS, _stale(("01_demo", first)))
    repo.commit("01 edited after its run, listed")
    second = _publish(repo, "02_demo", "z = 1")
    repo.write("outputs/cpu/02_demo.ipynb", _notebook("w = 1"))
    repo.commit("02 edited after its run")
    assert verify(repo.root).violations == [
        f"outputs/cpu/02_demo.ipynb: code cells differ from the run (of {second[:7]}); republish needed"]

    repo.write(STALE_RUNS, _stale(("01_demo", first), ("02_demo", second)))
    repo.commit("02 added to the list")
    violations = verify(repo.root).violations
    assert len(violations) == 1 and "was added after the list was first committed" in violations[0]

    repo.write(STALE_RUNS, _stale(("01_demo", first)))
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("x = 1"))  # 01 mended: its entry must go
    repo.write("outputs/cpu/02_demo.ipynb", _notebook("z = 1"))
    repo.commit("both mended")
    violations = verify(repo.root).violations
    assert any("01_demo" in violation and "remove the entry" in violation for violation in violations)
    assert any("added after" in violation for violation in violations)  # git keeps the addition, as for predictions


def test_a_run_records_the_hash_of_its_code_cells_and_verify_reads_it(tmp_path):
    from lora_lab.lab.provenance import code_cells_hash, provenance

    path = tmp_path / "01_demo.ipynb"
    path.write_text(_notebook("x = 1"))
    recorded = provenance("cpu", path)["code_cells_hash"]
    assert recorded == code_cells_hash(_notebook("x = 1", prose="other prose")) != code_cells_hash(_notebook("y = 1"))

    repo = Repo(tmp_path / "repo")
    repo.predictions()
    repo.commit("no notebook in the repository: only the recorded hash tells what ran")
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("y = 1"))
    repo.write("outputs/cpu/01_demo.metrics.json", json.dumps(
        {"notebook": "01_demo", "profile": "cpu", "metrics": {},
         "provenance": {"status": "completed", "git_commit": "a" * 40, "code_cells_hash": recorded}}))
    repo.commit("published")
    violations = verify(repo.root).violations
    assert any("01_demo.ipynb: code cells differ from the run" in violation for violation in violations)


def test_a_comment_is_not_code_but_a_changed_statement_is(tmp_path):
    repo = Repo(tmp_path / "repo")
    repo.predictions()
    ran = _publish(repo, "01_demo", "x = 1  # one\n\ny = x + 1\n")
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("x = 1  # the first value, said more clearly\ny = x + 1\n"))
    repo.commit("a comment reworded after the run")
    assert verify(repo.root).ok
    repo.write("outputs/cpu/01_demo.ipynb", _notebook("x = 2  # the first value, said more clearly\ny = x + 1\n"))
    repo.commit("a value changed after the run")
    assert verify(repo.root).violations == [
        f"outputs/cpu/01_demo.ipynb: code cells differ from the run (of {ran[:7]}); republish needed"]


def test_the_gpu_profile_copy_in_notebooks_is_checked_too(tmp_path):
    repo = Repo(tmp_path / "repo")
    repo.predictions()
    repo.write("notebooks/01_demo.ipynb", _notebook("x = 1"))
    ran = repo.commit("01: code")
    repo.write("outputs/gpu/01_demo.ipynb", _notebook("x = 1"))
    provenance = {"status": "completed", "git_commit": ran,
                  "notebook_hash": notebook_hash(repo.root / "notebooks" / "01_demo.ipynb")}
    repo.write("outputs/gpu/01_demo.metrics.json",
               json.dumps({"notebook": "01_demo", "profile": "gpu", "metrics": {}, "provenance": provenance}))
    repo.commit("01: published gpu run")
    assert verify(repo.root).ok
    repo.write("notebooks/01_demo.ipynb", _notebook("x = 1", prose="# demo, reworded"))
    repo.commit("the published notebook's prose reworded")
    assert verify(repo.root).ok
    repo.write("notebooks/01_demo.ipynb", _notebook("x = 3"))
    repo.commit("the published notebook's code edited")
    assert verify(repo.root).violations == [
        f"notebooks/01_demo.ipynb: code cells differ from the run (of {ran[:7]}); republish needed"]


FSTRING_CELL = ('x = f"a{b!r:>{w}}c" + g(1)  # note\ny = f"""\n{z}\n"""\n'
                'print(f"{fig.x(\'k\')} and {d[\'a\']:.3f}", rf"\\d{n}")\n')


def test_the_code_cells_hash_is_the_same_on_every_python():
    """Token names, not numbers (they shift between versions), and an f-string as one string token with its text
    (Python 3.12 splits it into parts): a hash recorded on the GPU machine's Python is the one computed here."""
    from lora_lab.lab.provenance import executed_tokens

    tokens = json.loads(executed_tokens(FSTRING_CELL))
    assert tokens[:4] == [["NAME", "x"], ["OP", "="], ["STRING", 'f"a{b!r:>{w}}c"'], ["OP", "+"]]
    assert ["STRING", 'f"""\n{z}\n"""'] in tokens and ["STRING", 'rf"\\d{n}"'] in tokens
    assert ["STRING", "f\"{fig.x('k')} and {d['a']:.3f}\""] in tokens
    assert not any(kind.startswith("FSTRING") or kind == "COMMENT" for kind, _ in tokens)


def test_verify_hashes_what_ran_from_the_notebook_at_its_commit_before_the_recorded_hash(tmp_path):
    """A run recorded by another Python (another tokenizer): the notebook at the run's commit, matched by its
    recorded notebook hash, is hashed here, like the published copy."""
    repo = Repo(tmp_path / "repo")
    repo.predictions()
    repo.write("notebooks/01_demo.ipynb", _notebook(FSTRING_CELL))
    ran = repo.commit("01: code")
    repo.write("outputs/cpu/01_demo.ipynb", _notebook(FSTRING_CELL))
    provenance = {"status": "completed", "git_commit": ran, "code_cells_hash": "0" * 64,  # another Python's
                  "notebook_hash": notebook_hash(repo.root / "notebooks" / "01_demo.ipynb")}
    repo.write("outputs/cpu/01_demo.metrics.json",
               json.dumps({"notebook": "01_demo", "profile": "cpu", "metrics": {}, "provenance": provenance}))
    repo.commit("published")
    assert verify(repo.root).ok
    repo.write("outputs/cpu/01_demo.ipynb", _notebook(FSTRING_CELL.replace("g(1)", "g(2)")))
    repo.commit("a value changed after the run")
    assert verify(repo.root).violations == [
        f"outputs/cpu/01_demo.ipynb: code cells differ from the run (of {ran[:7]}); republish needed"]
