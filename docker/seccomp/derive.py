"""Derive the sandbox's seccomp profile (executor/runtimes/docker/seccomp.json) from
Docker's default.

    python3 docker/seccomp/derive.py docker/seccomp/moby-default.json \
        > executor/runtimes/docker/seccomp.json

The input is moby's default profile, kept beside this script as it was fetched (see SOURCE).
The output is that profile minus what a code node never needs (docs/security.md says why):

- rules that only apply WITH a capability are dropped: every sandbox runs with --cap-drop ALL,
  so Docker would never use them (bpf, perf_event_open, mount, unshare, setns, ptrace ...);
- these calls are removed from every remaining rule: io_uring_*, userfaultfd, keyctl /
  add_key / request_key, bpf, perf_event_open, ptrace / process_vm_* / kcmp / pidfd_getfd,
  unshare / setns / mount and the new mount API, and socketcall (the 32-bit multiplexer
  whose arguments seccomp cannot see: a family filter on socket() would not hold);
- socket() is allowed for AF_UNIX only (the default allows every family but AF_ALG and
  AF_VSOCK): no AF_INET/AF_INET6 (the sandbox has no network, and neither Python nor Deno
  needs one to start: the language test programs and the isolation tests pass without),
  no AF_NETLINK, AF_PACKET, AF_VSOCK, AF_ALG;
- clone keeps Docker's argument filter (no CLONE_NEW* flag, so no new user namespace) and
  clone3 keeps its ENOSYS (libc falls back to clone, whose flags seccomp can see).

Anything not allowed fails with EPERM (defaultErrnoRet; Docker 20.10 ignores that field and
uses EPERM too).
"""

from __future__ import annotations

import json
import sys

SOURCE = (
    "moby/moby docker-v29.7.2-150-gb985e2313a (commit b985e2313a8676e18072b442911fc8f64f17d440),"
    " vendor/github.com/moby/profiles/seccomp/default.json = github.com/moby/profiles/seccomp"
    " v0.2.3"
)
REMOVED = {
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "process_madvise",
    "kcmp",
    "pidfd_getfd",
    "unshare",
    "setns",
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "mount_setattr",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "socketcall",
}
AF_UNIX = 1
ALLOWED_FAMILIES = (AF_UNIX,)


def derive(default: dict) -> dict:
    rules = []
    for rule in default["syscalls"]:
        if rule.get("includes", {}).get("caps"):
            continue  # needs a capability the sandbox never has
        names = [n for n in rule["names"] if n not in REMOVED]
        if not names:
            continue
        if names == ["socket"]:
            continue  # replaced below: AF_UNIX only
        rules.append({**rule, "names": names})
    for family in ALLOWED_FAMILIES:
        rules.append(
            {
                "names": ["socket"],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}],
                "comment": "studio-code: AF_UNIX sockets only (no network, netlink, packet, vsock)",
            }
        )
    return {
        "comment": "studio-code code-node sandbox profile, derived by docker/seccomp/derive.py "
        "from Docker's default profile: " + SOURCE,
        "defaultAction": default["defaultAction"],
        "defaultErrnoRet": default.get("defaultErrnoRet", 1),
        "archMap": default["archMap"],
        "syscalls": rules,
    }


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        default = json.load(f)
    json.dump(derive(default), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
