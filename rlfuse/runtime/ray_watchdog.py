"""Ends the local Ray a run started once that run's driver is gone without shutting it down (SIGKILL, the OOM
killer): its GCS, raylet and workers would otherwise run on for minutes. ray_driver.start_ray starts it as
`python -m rlfuse.runtime.ray_watchdog DRIVER_PID SESSION_DIR` and stops it on a clean shutdown. Imports no Ray:
the session's processes are found by the session name on their command lines or the session's files they hold."""

from __future__ import annotations

import os
import sys
import time

import psutil


def session_processes(session_dir: str) -> list[psutil.Process]:
    """The processes of one Ray session, not this one: those naming it on their command line (GCS, raylet,
    workers) and Ray's agents, which rename themselves (ray::DashboardAgent) but keep its log files open."""
    name, found = os.path.basename(session_dir.rstrip("/")), []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = " ".join(p.info["cmdline"] or [])
            if p.pid == os.getpid() or "ray" not in cmdline.lower():
                continue
            if name in cmdline or any(f.path.startswith(session_dir) for f in p.open_files()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def driver_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def end_session(session_dir: str, grace_s: float = 5.0) -> int:
    """SIGTERM every process of the session, SIGKILL what is left after grace_s; returns how many there were."""
    procs = session_processes(session_dir)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return len(procs)


def main(argv: list[str]) -> int:
    driver, session_dir = int(argv[0]), argv[1]
    while driver_alive(driver):
        time.sleep(1.0)
    end_session(session_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
