#!/usr/bin/env python3
"""Run a neuron and keep it on the newest release of this repository: pull, reinstall and restart it between rounds.

    python scripts/auto_update.py --every 5 -- .venv/bin/python neurons/miner.py --netuid 38 --wallet.name ...

Why: a release that raises ``template.__version__`` also raises ``template.spec_version``, the version key of the
validator's weights, and the chain refuses the weights of a validator left on the old one; operators run neurons
under pm2 (``scripts/run_neuron.sh`` starts this script there) and expect them to follow releases by themselves.

What happens: the updater starts the neuron (the command after ``--``, in the repository, in its own process group)
and, every ``--every`` minutes, runs ``git fetch REMOTE BRANCH``. A release is a remote commit whose
``template/__init__.py`` has another ``__version__`` than the checkout's; commits that leave the version alone are
not pulled. On a release:

1. the neuron is asked to stop after the round in progress: SIGUSR1 to its own process (not its group, so that
   hivemind's helper processes finish the all-reduce in flight). It finishes inner training and the all-reduce,
   checkpoints the round and exits 0; ``--stop-timeout`` bounds the wait, then it gets SIGTERM, then SIGKILL;
2. ``git merge --ff-only`` to the release, then the install command (default ``python -m pip install -e .`` with this
   script's Python);
3. the neuron is started again with the same command: it resumes from its checkpoint;
4. if the install fails or the new neuron exits within ``--healthy-after`` seconds, the checkout is reset to the last
   good commit (``git reset --hard``), installed again and the neuron started there; the log says
   ``ROLLED BACK to <commit> (version V): release W (<commit>) <why>``. The failed commit is remembered in
   ``.git/auto_update.json`` and never tried again; a later release is.

Everything is logged to stdout, one line per step, prefixed ``auto-update``; the neuron's own output goes to the same
stdout/stderr (pm2 keeps both). It never contacts anything but the git remote.

On failure: a fetch that fails or times out (``--git-timeout``) is logged and tried again at the next check; local
commits that keep a fast-forward from happening are logged once per release and the release is skipped (nothing is
overwritten); a neuron that dies by itself ends the updater with the neuron's exit status, so that pm2 restarts both.
SIGINT/SIGTERM (``pm2 stop``) stop the neuron (SIGTERM to its process group, SIGKILL after ``--stop-grace`` seconds)
and end the updater with status 0. Every wait is bounded; only the watch loop itself runs until one of these ends it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("auto-update")

VERSION_FILE = "template/__init__.py"
VERSION = re.compile(r'^__version__ = "([^"]+)"', re.M)  # as setup.py reads it
STATE_FILE = "auto_update.json"  # in the checkout's .git directory: never committed, never pulled
BAD_KEPT = 50
POLL_S = 0.5


class UpdateError(RuntimeError):
    """A git or install step failed (its output is in the message)."""


@dataclass(frozen=True)
class UpdaterConfig:
    """What the updater runs and how it checks for releases (one field per flag)."""

    command: tuple[str, ...]  # the neuron, run in `repo`
    repo: Path = Path(".")
    remote: str = "origin"
    branch: str | None = None  # None: the checkout's current branch
    every_s: float = 300.0  # between two checks of the remote
    healthy_after_s: float = 120.0  # a started neuron that lives this long is good
    stop_timeout_s: float = 1800.0  # the longest a round (and its checkpoint) may take after the stop request
    stop_grace_s: float = 30.0  # after SIGTERM, before SIGKILL
    install: tuple[str, ...] = field(default=(sys.executable, "-m", "pip", "install", "--quiet", "-e", "."))
    git_timeout_s: float = 120.0
    install_timeout_s: float = 1800.0


@dataclass(frozen=True)
class Release:
    commit: str
    version: str


def version_in(text: str) -> str | None:
    match = VERSION.search(text)
    return match.group(1) if match else None


def signal_caught(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (Linux: ``SigCgt`` in /proc); True where that cannot be
    read. A neuron installs its SIGUSR1 handler a few seconds after it starts; before that, SIGUSR1 would kill it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    match = re.search(r"^SigCgt:\s*([0-9a-fA-F]+)$", status, re.M)
    return match is None or bool(int(match.group(1), 16) >> (signum - 1) & 1)


class Updater:
    """The neuron process and the checkout it runs from."""

    def __init__(self, config: UpdaterConfig, stopping: threading.Event) -> None:
        self.config = config
        self.repo = config.repo.resolve()
        self.stopping = stopping  # set by SIGINT/SIGTERM
        self.neuron: subprocess.Popen | None = None
        self.branch = config.branch or self.git("rev-parse", "--abbrev-ref", "HEAD")
        self.state_path = self.repo / self.git("rev-parse", "--git-dir") / STATE_FILE
        self._skipped: set[str] = set()  # releases that cannot be fast-forwarded to (logged once)

    # ------------------------------------------------------------------------------------------ git and install

    def git(self, *args: str) -> str:
        return self._run(["git", *args], self.config.git_timeout_s)

    def _run(self, command: list[str] | tuple[str, ...], timeout: float) -> str:
        try:
            done = subprocess.run(command, cwd=self.repo, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise UpdateError(f"`{shlex.join(command)}` took longer than {timeout:.0f}s") from None
        except OSError as err:
            raise UpdateError(f"`{shlex.join(command)}` could not run: {err}") from None
        if done.returncode != 0:
            output = (done.stderr or done.stdout).strip()[-2000:]
            raise UpdateError(f"`{shlex.join(command)}` exited with {done.returncode}: {output}")
        return done.stdout.strip()

    def install(self) -> None:
        self._run(self.config.install, self.config.install_timeout_s)

    def local_version(self) -> str | None:
        return version_in((self.repo / VERSION_FILE).read_text())

    def bad_commits(self) -> list[str]:
        try:
            return list(json.loads(self.state_path.read_text())["bad"])
        except (OSError, ValueError, KeyError, TypeError):
            return []

    def remember_bad(self, commit: str) -> None:
        bad = [c for c in self.bad_commits() if c != commit][-(BAD_KEPT - 1):] + [commit]
        self.state_path.write_text(json.dumps({"bad": bad}, indent=1))

    def release(self) -> Release | None:
        """The remote's newest commit if it is a release not yet tried and failed here; None otherwise."""
        remote = self.config.remote
        self.git("fetch", "--quiet", remote, self.branch)
        commit = self.git("rev-parse", "FETCH_HEAD")
        version = version_in(self.git("show", f"{commit}:{VERSION_FILE}"))
        if version is None or version == self.local_version() or commit in self.bad_commits():
            return None
        if commit in self._skipped:
            return None
        try:
            self.git("merge-base", "--is-ancestor", "HEAD", commit)
        except UpdateError:
            self._skipped.add(commit)
            log.warning("release %s (%s) is not a fast-forward of this checkout (local commits?): not updating",
                        version, commit[:12])
            return None
        return Release(commit, version)

    # ------------------------------------------------------------------------------------------ the neuron

    def start_neuron(self) -> None:
        log.info("starting the neuron at %s (version %s): %s", self.git("rev-parse", "--short=12", "HEAD"),
                 self.local_version(), shlex.join(self.config.command))
        self.neuron = subprocess.Popen(self.config.command, cwd=self.repo, start_new_session=True,
                                       stdin=subprocess.DEVNULL)

    def watch(self, seconds: float) -> int | None:
        """Wait up to ``seconds`` (or until a stop is asked); the neuron's exit code if it exited meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.stopping.is_set():
            code = self.neuron.poll()
            if code is not None:
                return code
            self.stopping.wait(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
        return self.neuron.poll()

    def healthy(self) -> int | None:
        """None once the neuron has lived ``--healthy-after`` seconds; its exit code if it exited before."""
        return self.watch(self.config.healthy_after_s)

    def stop_after_round(self) -> int:
        """Ask the neuron to finish its round and exit; stop it if it cannot be asked (it has no SIGUSR1 handler
        within ``--healthy-after`` seconds, e.g. under torchrun) or takes longer than ``--stop-timeout``. Returns
        its exit code."""
        pid = self.neuron.pid
        ask_by = time.monotonic() + self.config.healthy_after_s
        while self.neuron.poll() is None and not signal_caught(pid, signal.SIGUSR1) and time.monotonic() < ask_by:
            self.stopping.wait(POLL_S)
        if self.neuron.poll() is not None:
            return self.neuron.returncode
        if not signal_caught(pid, signal.SIGUSR1):
            log.warning("the neuron (pid %d) does not handle SIGUSR1: stopping it with SIGTERM", pid)
            return self.terminate()
        log.info("asking the neuron (pid %d) to stop after the round in progress", pid)
        os.kill(pid, signal.SIGUSR1)
        code = self.watch(self.config.stop_timeout_s)
        if code is None and not self.stopping.is_set():
            log.warning("the neuron did not stop within %.0fs: stopping it now", self.config.stop_timeout_s)
        return self.terminate() if code is None else code

    def terminate(self) -> int:
        """SIGTERM to the neuron's process group, SIGKILL after ``--stop-grace``; its exit code."""
        if self.neuron is None:
            return 0
        for signum, wait in ((signal.SIGTERM, self.config.stop_grace_s), (signal.SIGKILL, 30.0)):
            if self.neuron.poll() is None:
                try:
                    os.killpg(self.neuron.pid, signum)
                except ProcessLookupError:
                    break
                try:
                    self.neuron.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
        try:
            os.killpg(self.neuron.pid, signal.SIGKILL)  # what the neuron left behind (hivemind's helpers)
        except ProcessLookupError:
            pass
        return self.neuron.wait(timeout=30)

    # ------------------------------------------------------------------------------------------ an update

    def update(self, release: Release) -> int | None:
        """Move to ``release`` between rounds, or back to the last good commit; None while a neuron runs, else the
        exit code of a neuron that fails on the last good commit too."""
        good, good_version = self.git("rev-parse", "HEAD"), self.local_version()
        log.info("new release %s (%s) on %s/%s; this is %s", release.version, release.commit[:12],
                 self.config.remote, self.branch, good_version)
        code = self.stop_after_round()
        log.info("the neuron stopped (exit code %s)", code)
        if self.stopping.is_set():
            return None
        try:
            self.git("merge", "--ff-only", "--quiet", release.commit)
            self.install()
        except UpdateError as err:
            return self.roll_back(good, good_version, release, f"did not install: {err}")
        self.start_neuron()
        code = self.healthy()
        if code is not None and not self.stopping.is_set():
            return self.roll_back(good, good_version, release,
                                  f"failed to start: the neuron exited with code {code} within "
                                  f"{self.config.healthy_after_s:.0f}s")
        log.info("updated %s -> %s (%s)", good_version, release.version, release.commit[:12])
        return None

    def roll_back(self, good: str, good_version: str | None, release: Release, why: str) -> int | None:
        self.remember_bad(release.commit)
        self.git("reset", "--hard", "--quiet", good)
        log.error("ROLLED BACK to %s (version %s): release %s (%s) %s", good[:12], good_version, release.version,
                  release.commit[:12], why)
        try:
            self.install()
        except UpdateError as err:
            log.error("installing the last good commit failed too: %s", err)
        self.start_neuron()
        code = self.healthy()
        if code is not None and not self.stopping.is_set():
            log.error("the neuron fails on the last good commit too (exit code %d)", code)
        return code

    def run(self) -> int:
        """Start the neuron and follow releases until the neuron exits by itself or a stop is asked."""
        self.start_neuron()
        code = self.healthy()
        while code is None and not self.stopping.is_set():
            code = self.watch(self.config.every_s)
            if code is not None or self.stopping.is_set():
                break
            try:
                release = self.release()
            except UpdateError as err:
                log.warning("checking for a release failed: %s; trying again in %.0fs", err, self.config.every_s)
                continue
            if release is not None:
                code = self.update(release)
        if self.stopping.is_set():
            log.info("stopping the neuron")
            self.terminate()
            return 0
        log.error("the neuron exited by itself with code %d", code)
        return code


def build_parser() -> argparse.ArgumentParser:
    defaults = UpdaterConfig(command=())
    parser = argparse.ArgumentParser(prog="scripts/auto_update.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", default=str(defaults.repo), help="the git checkout the neuron runs from")
    parser.add_argument("--remote", default=defaults.remote, help="git remote to follow (default %(default)s)")
    parser.add_argument("--branch", default=None, help="branch to follow (default: the checkout's current branch)")
    parser.add_argument("--every", type=float, default=defaults.every_s / 60,
                        help="minutes between two checks of the remote (default %(default)s)")
    parser.add_argument("--healthy-after", type=float, default=defaults.healthy_after_s,
                        help="seconds a restarted neuron must run for its release to count as good (default "
                             "%(default)s)")
    parser.add_argument("--stop-timeout", type=float, default=defaults.stop_timeout_s,
                        help="seconds the neuron may take to finish its round after the stop request (default "
                             "%(default)s)")
    parser.add_argument("--stop-grace", type=float, default=defaults.stop_grace_s,
                        help="seconds between SIGTERM and SIGKILL when the neuron must be stopped (default "
                             "%(default)s)")
    parser.add_argument("--install", default=shlex.join(defaults.install),
                        help="command that installs a checkout, run in the repository (default: %(default)s)")
    parser.add_argument("--git-timeout", type=float, default=defaults.git_timeout_s,
                        help="seconds one git command may take (default %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the neuron's command line")
    return parser


def config_from_args(argv: list[str] | None) -> UpdaterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the neuron's command after --")
    if min(args.every, args.healthy_after, args.stop_timeout, args.stop_grace, args.git_timeout) <= 0:
        parser.error("--every, --healthy-after, --stop-timeout, --stop-grace and --git-timeout must be > 0")
    return UpdaterConfig(command=tuple(command), repo=Path(args.repo), remote=args.remote, branch=args.branch,
                         every_s=args.every * 60, healthy_after_s=args.healthy_after, stop_timeout_s=args.stop_timeout,
                         stop_grace_s=args.stop_grace, install=tuple(shlex.split(args.install)),
                         git_timeout_s=args.git_timeout)


def main(argv: list[str] | None = None) -> int:
    config = config_from_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="auto-update %(asctime)s %(message)s")
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    try:
        updater = Updater(config, stopping)
    except UpdateError as err:
        log.error("%s: is --repo %s a git checkout?", err, config.repo)
        return 2
    try:
        return updater.run()
    finally:
        updater.terminate()  # whatever ended the run (an error included), the neuron does not outlive the updater


if __name__ == "__main__":
    sys.exit(main())
