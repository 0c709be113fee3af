"""tests/conftest.py collects the files that hold a slow test first, so that pytest-xdist, which make test runs with
``--dist loadfile --no-loadscope-reorder``, starts the longest files early."""


def test_files_with_a_slow_test_come_first(request):
    files: dict = {}  # path -> holds a slow test, in the session's order
    for item in request.session.items:
        files[item.path] = files.get(item.path, False) or item.get_closest_marker("slow") is not None
    flags = list(files.values())
    assert flags == sorted(flags, reverse=True), [path.name for path in files]
    assert request.node.path in files and not files[request.node.path]
