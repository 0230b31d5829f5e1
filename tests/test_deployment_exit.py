"""A script that uses ``Deployment`` exits 0. The consumer's P2P listener ran its accept
and session threads without joining them on close: a thread still ending when the
interpreter finalized dropped the listener's tensors without the GIL and the process
died of SIGABRT ("terminate called without an active exception"), about three runs in
four on a 2-core CPU. Checked in a child process, as a user's script runs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    import threading
    from pdflow import Deployment, SamplingParams, compose
    spec = compose(["drafter=none", "tracking=off", "prefill=tp1", "decode=tp1", "transfer=nccl",
                    "prefill.block_size=16", "decode.block_size=16", "prefill.kv_page_tokens=16",
                    "decode.kv_page_tokens=16"])
    with Deployment(spec) as d:
        d.generate([[5, 6, 7, 8] * 40], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    print("left:", json.dumps(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())))
""")


def test_a_deployment_script_exits_zero_with_no_transfer_thread_left():
    for _ in range(2):  # the abort was a race at exit: two runs catch it ~15 times in 16
        out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (out.returncode, out.stdout[-1000:], out.stderr[-2000:])
        left = next(line for line in out.stdout.splitlines() if line.startswith("left:"))
        assert not [n for n in json.loads(left[5:]) if n.startswith(("p2p-", "kv-"))], left
