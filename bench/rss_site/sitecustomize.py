"""Loaded at the start of every Python process whose PYTHONPATH has this folder first (bench/rss_trace.py puts it
there): with RLFUSE_RSS_TRACE set to a folder, a daemon thread samples the process's RSS (VmRSS and its anonymous,
file-backed and shared parts, /proc/self/status) every RLFUSE_RSS_TRACE_MS milliseconds and notes the Python stack
of the thread running rlfuse code at that moment. It writes rss-<pid>.json there every second and at exit: the
process's command line, a timeline (a row where the innermost rlfuse frames change or the RSS moves 50 MiB) and the
peak with its whole stack. Not imported by rlfuse; a development tool, Linux only."""

import atexit
import json
import os
import sys
import threading
import time
import traceback


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out


def _stack() -> list[str]:
    """The deepest stack among the other threads', cut to the frames of rlfuse's and torch.optim's code."""
    best = []
    for tid, frame in sys._current_frames().items():
        if tid == threading.get_ident():
            continue
        frames = [f"{os.path.basename(f.filename)}:{f.name}" for f in traceback.extract_stack(frame)
                  if "rlfuse" in f.filename or "torch/optim" in f.filename]
        if len(frames) > len(best):
            best = frames
    return best


def _start(folder: str, every: float) -> None:
    path = os.path.join(folder, f"rss-{os.getpid()}.json")
    t0, state = time.time(), {"timeline": [], "peak": None}
    lock = threading.Lock()

    def flush():  # from the sampler and at exit: one at a time, each file whole
        with lock:
            data = {"pid": os.getpid(), "argv": sys.argv[:1] + [a[:200] for a in sys.argv[1:12]], **state}
            with open(path + ".tmp", "w") as f:
                json.dump(data, f)
            os.replace(path + ".tmp", path)

    def loop():
        last_key, last_rss, last_flush = None, 0.0, 0.0
        while True:
            try:
                s, stack = _status(), _stack()
            except (OSError, ValueError):
                return
            row = {"t": round(time.time() - t0, 3), "rss": s["VmRSS"], "anon": s["RssAnon"], "file": s["RssFile"],
                   "shm": s["RssShmem"], "where": " > ".join(stack[-3:])}
            key = tuple(stack[-3:])
            with lock:
                if state["peak"] is None or s["VmRSS"] > state["peak"]["rss"]:
                    state["peak"] = dict(row, stack=stack)
                if key != last_key or abs(s["VmRSS"] - last_rss) > 50:
                    state["timeline"].append(row)
                    last_key, last_rss = key, s["VmRSS"]
            if time.time() - last_flush > 1.0:
                flush()
                last_flush = time.time()
            time.sleep(every)

    threading.Thread(target=loop, daemon=True, name="rss-trace").start()
    atexit.register(flush)


if os.environ.get("RLFUSE_RSS_TRACE") and sys.platform.startswith("linux"):
    _start(os.environ["RLFUSE_RSS_TRACE"], float(os.environ.get("RLFUSE_RSS_TRACE_MS", "10")) / 1000)
