"""The code interpreter's seccomp filter: system calls sandboxed code never needs answer EPERM.

Built once with libseccomp (pyseccomp: ctypes bindings of Debian's libseccomp2, API-compatible
with libseccomp's own Python module) and handed to bubblewrap as compiled BPF (`--seccomp FD`, a
fresh memfd per run), which loads it just before it starts the code: bubblewrap's own set-up is
not filtered, everything the code and its children do is. Everything else is allowed (a deny
list: Python, numpy and subprocesses keep working); system calls of another architecture (32-bit
x86 on x86-64) are refused by libseccomp's architecture check.

What it adds to the namespaces: no ptrace at all (not even of the code's own children), no new
namespaces (unshare, setns, clone with CLONE_NEW*), no mounts, and none of the kernel interfaces
behind most local privilege escalations (bpf, perf_event_open, userfaultfd, io_uring, keyrings,
modules, kexec, open_by_handle_at).
"""

from __future__ import annotations

import errno
import os
import tempfile
from functools import lru_cache

DENIED = (
    # other processes' memory and state
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    # namespaces and mounts (a way back to capabilities inside a new user namespace)
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fsconfig", "fspick",
    "move_mount", "open_tree", "mount_setattr",
    # kernel interfaces a Python program never needs, and behind most local privilege escalations
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module", "kexec_load",
    "kexec_file_load", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "swapon", "swapoff",
    "reboot", "acct", "quotactl", "syslog", "uselib", "vhangup", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "lookup_dcookie", "nfsservctl", "sysfs", "_sysctl",
)
CLONE_NEW = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
             "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
             "CLONE_NEWNET": 0x40000000}  # (CLONE_NEWTIME is unshare's and clone3's only: both refused)


class SeccompUnavailable(RuntimeError):
    pass


@lru_cache(maxsize=1)
def program() -> bytes:
    """The compiled BPF program (raises SeccompUnavailable when libseccomp cannot be loaded)."""
    try:
        import pyseccomp as seccomp

        flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    except Exception as exc:  # noqa: BLE001 - no libseccomp2 on this host, or an unusable one
        raise SeccompUnavailable(f"libseccomp cannot be used ({type(exc).__name__}: {exc}); install Debian's "
                                 "libseccomp2, or set TOKENSTREAM_TOOLS_SECCOMP=false") from None
    deny = seccomp.ERRNO(errno.EPERM)
    for name in DENIED:
        try:
            flt.add_rule(deny, name)
        except (ValueError, OSError):
            pass  # a system call this kernel and libseccomp do not know: nothing to deny
    for flag in CLONE_NEW.values():  # clone() making a namespace; clone3's flags are in memory: ENOSYS
        flt.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")  # glibc then falls back to clone()
    with tempfile.TemporaryFile() as out:
        flt.export_bpf(out)
        out.seek(0)
        return out.read()


def program_fd() -> int:
    """A new memfd holding the program, at offset 0: bubblewrap reads (and consumes) one per run."""
    fd = os.memfd_create("ts-seccomp", os.MFD_CLOEXEC)
    data = program()
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
