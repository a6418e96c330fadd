"""The suite's budget, measured on every run: each test module's wall time, the test
process's resident memory when the module ends and its peak during it, and the peak of the
whole process tree (servers and children the module started), sampled. The table is printed
at the end of the run; `--budget-report FILE` writes it as Markdown too (`make test-budget`).
Under pytest-xdist each worker measures its own modules and hands them to the controller,
whose sampled peak covers every worker and their children.
docs/architecture.md, "Test layers", says what the budget is and how tests keep within it."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass, field

import psutil
import pytest

GIB = 1 << 30
SAMPLE_S = 0.2


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Linux resets VmHWM to the current RSS on writing 5 to clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


@dataclass
class ModuleBudget:
    name: str
    start: float
    rss_before: int
    seconds: float = 0.0
    rss_after: int = 0
    peak_self: int = 0
    peak_tree: int = 0
    tests: int = 0


@dataclass
class Budget:
    modules: list[ModuleBudget] = field(default_factory=list)
    current: ModuleBudget | None = None
    tree_peak_now: int = 0
    tree_peak_run: int = 0  # the whole run's, never reset
    started: float = field(default_factory=time.monotonic)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.proc = psutil.Process(os.getpid())
        self.lock = threading.Lock()
        self.sampler = threading.Thread(target=self._sample, name="budget-sampler", daemon=True)
        self.sampler.start()

    def _sample(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            rss = _tree_rss(self.proc)
            with self.lock:
                self.tree_peak_now = max(self.tree_peak_now, rss)
                self.tree_peak_run = max(self.tree_peak_run, rss)

    def enter(self, module: str) -> None:
        if self.current is not None and self.current.name == module:
            return
        self.leave()
        _reset_peak()
        with self.lock:
            self.tree_peak_now = _tree_rss(self.proc)
        self.current = ModuleBudget(module, time.monotonic(), self.proc.memory_info().rss)

    def leave(self) -> None:
        m = self.current
        if m is None:
            return
        m.seconds = time.monotonic() - m.start
        m.rss_after = self.proc.memory_info().rss
        m.peak_self = _status_kib("VmHWM") * 1024
        with self.lock:
            m.peak_tree = max(self.tree_peak_now, m.peak_self)
        self.modules.append(m)
        self.current = None

    def close(self) -> None:
        self.leave()
        self.stop.set()

    def total_minutes(self) -> float:
        return (time.monotonic() - self.started) / 60

    def peaks(self) -> tuple[int, int]:
        return (max((m.peak_self for m in self.modules), default=0),
                max([self.tree_peak_run, *(m.peak_tree for m in self.modules)]))

    def table(self) -> str:
        rows = ["| module | tests | seconds | RSS after (GiB) | growth (GiB) | peak, test process (GiB) | peak, with children (GiB) |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for m in sorted(self.modules, key=lambda m: -m.seconds):
            rows.append(f"| {m.name} | {m.tests} | {m.seconds:.0f} | {m.rss_after / GIB:.2f} | "
                        f"{(m.rss_after - m.rss_before) / GIB:+.2f} | {m.peak_self / GIB:.2f} | "
                        f"{m.peak_tree / GIB:.2f} |")
        return "\n".join(rows)

    def summary(self) -> str:
        peak_self, peak_tree = self.peaks()
        return (f"test budget: {self.total_minutes():.1f} min of tests, peak resident "
                f"{peak_self / GIB:.2f} GiB in one test process, {peak_tree / GIB:.2f} GiB "
                f"for all its processes together")


_budget: Budget | None = None
_xdist_controller = False  # this process hands tests to pytest-xdist workers


def pytest_addoption(parser):
    parser.addoption("--budget-report", metavar="FILE", default=None,
                     help="write each test module's time and memory as a Markdown table")


def pytest_sessionstart(session):
    global _budget, _xdist_controller
    _budget = Budget()
    _xdist_controller = (session.config.pluginmanager.hasplugin("dsession")
                         and getattr(session.config.option, "numprocesses", None) not in (None, 0))


def pytest_runtest_logstart(nodeid, location):
    if _budget is not None and not _xdist_controller:
        _budget.enter(nodeid.split("::")[0])
        _budget.current.tests += 1


def pytest_sessionfinish(session):
    """An xdist worker: its modules go to the controller."""
    if _budget is not None and hasattr(session.config, "workeroutput"):
        _budget.close()
        session.config.workeroutput["budget"] = [asdict(m) for m in _budget.modules]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller: a worker's modules, measured there."""
    if _budget is not None:
        _budget.modules += [ModuleBudget(**m) for m in node.workeroutput.get("budget", [])]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _budget is None:
        return
    _budget.close()
    terminalreporter.write_sep("-", "time and memory per test module")
    terminalreporter.write_line(_budget.table())
    terminalreporter.write_line(_budget.summary())
    path = config.getoption("--budget-report")
    if path:
        with open(path, "w") as f:
            f.write(_budget.table() + "\n\n" + _budget.summary() + "\n")
