"""The code interpreter's seccomp filter: an allow list; every other system call answers EPERM.

Built once with libseccomp (pyseccomp: ctypes bindings of Debian's libseccomp2, API-compatible
with libseccomp's own Python module) and handed to bubblewrap as compiled BPF (`--seccomp FD`, a
fresh memfd per run), which loads it just before it starts the code: bubblewrap's own set-up is
not filtered; its init (pid 1 of the sandbox), the code and every child the code starts are.
System calls of another architecture (32-bit x86, x32 on x86-64) are refused by libseccomp's
architecture check.

The list was measured: every system call made under the filter (bubblewrap's init, the launcher,
the code and its children) by strace (`strace -ff` around the sandbox) over the escape suites, a
stdlib workload (files, sqlite, zip/tar, threads, subprocess, fork, multiprocessing pools and
shared memory, asyncio, sockets that fail, ctypes, signals, timers) and a numpy workload (BLAS and
LAPACK, FFT, random, save/load, memmap, threads), plus the close relatives glibc picks among
(openat/open, newfstatat/statx, faccessat2, the *at forms) so a library choosing the other one keeps
working. Left out on purpose, and so refused: ptrace and every way at another process's memory;
new namespaces, mounts, chroot; the kernel interfaces behind most local privilege escalations
(bpf, perf_event_open, userfaultfd, io_uring, keyrings, modules, kexec, handles); memfd_create and
System V shared memory and queues (memory that no rlimit counts); chown and the set*id family;
mknod; personality; clock setting; socket families other than local, IPv4/6 and netlink.
"""

from __future__ import annotations

import errno
import os
import tempfile
from functools import lru_cache

ALLOWED = {
    # starting a program and its memory (glibc's start-up, malloc, dlopen of extension modules)
    "memory": (
        "execve",
        "brk",
        "mmap",
        "munmap",
        "mremap",
        "mprotect",
        "madvise",
        "msync",
        "mincore",
        "arch_prctl",
        "set_tid_address",
        "set_robust_list",
        "get_robust_list",
        "rseq",
        "exit",
        "exit_group",
        "restart_syscall",
        "membarrier",
    ),
    # files: the working folder, /tmp, /dev/shm, the read-only /usr (Python imports, sqlite, zipfile,
    # shutil: copy uses sendfile, copystat the xattrs; fallocate and writes stay under RLIMIT_FSIZE)
    "files": (
        "read",
        "write",
        "readv",
        "writev",
        "pread64",
        "pwrite64",
        "preadv",
        "pwritev",
        "preadv2",
        "pwritev2",
        "open",
        "openat",
        "creat",
        "close",
        "close_range",
        "lseek",
        "fstat",
        "stat",
        "lstat",
        "newfstatat",
        "statx",
        "access",
        "faccessat",
        "faccessat2",
        "readlink",
        "readlinkat",
        "getdents64",
        "getcwd",
        "chdir",
        "fchdir",
        "mkdir",
        "mkdirat",
        "rmdir",
        "unlink",
        "unlinkat",
        "rename",
        "renameat",
        "renameat2",
        "link",
        "linkat",
        "symlink",
        "symlinkat",
        "chmod",
        "fchmod",
        "fchmodat",
        "truncate",
        "ftruncate",
        "fallocate",
        "fsync",
        "fdatasync",
        "sync_file_range",
        "utimensat",
        "utime",
        "utimes",
        "futimesat",
        "fadvise64",
        "readahead",
        "statfs",
        "fstatfs",
        "umask",
        "flock",
        "sendfile",
        "copy_file_range",
        "getxattr",
        "lgetxattr",
        "fgetxattr",
        "listxattr",
        "llistxattr",
        "flistxattr",
        "setxattr",
        "lsetxattr",
        "fsetxattr",
        "removexattr",
        "lremovexattr",
        "fremovexattr",
        "dup",
        "dup2",
        "dup3",
        "fcntl",
    ),
    # waiting on descriptors (selectors, asyncio, subprocess's pipes, multiprocessing's queues)
    "waiting": (
        "pipe",
        "pipe2",
        "eventfd2",
        "poll",
        "ppoll",
        "select",
        "pselect6",
        "epoll_create",
        "epoll_create1",
        "epoll_ctl",
        "epoll_wait",
        "epoll_pwait",
        "epoll_pwait2",
    ),
    # threads and their locks (threading, concurrent.futures, OpenBLAS's threads)
    "threads": (
        "futex",
        "futex_waitv",
        "gettid",
        "tgkill",
        "tkill",
        "sched_yield",
        "sched_getaffinity",
        "sched_getparam",
        "sched_getscheduler",
        "sched_get_priority_max",
        "sched_get_priority_min",
        "getcpu",
    ),
    # processes of its own (fork, vfork, subprocess, multiprocessing); clone only without CLONE_NEW*
    "processes": (
        "fork",
        "vfork",
        "wait4",
        "waitid",
        "kill",
        "getpid",
        "getppid",
        "getpgrp",
        "getpgid",
        "setpgid",
        "getsid",
        "setsid",
        "getpriority",
        "setpriority",
        "prctl",
        "prlimit64",
        "getrlimit",
        "setrlimit",
        "getrusage",
        "times",
    ),
    # signals (signal handlers, alarms, timeouts, faulthandler)
    "signals": (
        "rt_sigaction",
        "rt_sigprocmask",
        "rt_sigreturn",
        "rt_sigsuspend",
        "rt_sigpending",
        "rt_sigtimedwait",
        "sigaltstack",
        "pause",
        "alarm",
        "setitimer",
        "getitimer",
    ),
    # time (the vDSO answers most; these are its fallbacks) and random numbers
    "time": (
        "clock_gettime",
        "clock_getres",
        "clock_nanosleep",
        "nanosleep",
        "gettimeofday",
        "time",
        "getrandom",
    ),
    # who and where it is (all answered inside the namespaces: uid 65534, its own hostname)
    "identity": (
        "getuid",
        "geteuid",
        "getgid",
        "getegid",
        "getresuid",
        "getresgid",
        "getgroups",
        "uname",
        "sysinfo",
    ),
    # sockets: the network namespace has only its own empty loopback, so these reach nothing outside;
    # they are allowed so that code gets the usual errors (connection refused, no resolver)
    "sockets": (
        "socketpair",
        "bind",
        "listen",
        "accept",
        "accept4",
        "connect",
        "getsockname",
        "getpeername",
        "getsockopt",
        "setsockopt",
        "sendto",
        "recvfrom",
        "sendmsg",
        "recvmsg",
        "sendmmsg",
        "recvmmsg",
        "shutdown",
    ),
}
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10, "AF_NETLINK": 16}  # (if_nameindex: netlink)
IOCTLS = {  # requests on terminals, descriptors and interfaces that Python and numpy make; no other
    "TCGETS": 0x5401,
    "TIOCGPGRP": 0x540F,
    "TIOCGWINSZ": 0x5413,
    "FIONREAD": 0x541B,
    "FIONBIO": 0x5421,
    "FIONCLEX": 0x5450,
    "FIOCLEX": 0x5451,
    "SIOCGIFNAME": 0x8910,
    "SIOCGIFCONF": 0x8912,
    "SIOCGIFFLAGS": 0x8913,
    "SIOCGIFADDR": 0x8915,
    "SIOCGIFMTU": 0x8921,
    "SIOCGIFHWADDR": 0x8927,
    "SIOCGIFINDEX": 0x8933,
}
CLONE_NEW = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET: a clone making none
# (CLONE_NEWTIME is unshare's and clone3's only: unshare is refused, clone3 answers ENOSYS, below)


class SeccompUnavailable(RuntimeError):
    pass


def allowed() -> list[str]:
    return [name for group in ALLOWED.values() for name in group]


@lru_cache(maxsize=1)
def program() -> bytes:
    """The compiled BPF program (raises SeccompUnavailable when libseccomp cannot be loaded)."""
    try:
        import pyseccomp as seccomp

        flt = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
    except Exception as exc:  # noqa: BLE001 - no libseccomp2 on this host, or an unusable one
        raise SeccompUnavailable(
            f"libseccomp cannot be used ({type(exc).__name__}: {exc}); install Debian's "
            "libseccomp2, or set TOKENSTREAM_TOOLS_SECCOMP=false"
        ) from None
    for name in allowed():
        try:
            flt.add_rule(seccomp.ALLOW, name)
        except (ValueError, OSError):
            pass  # not a system call of this architecture (e.g. a legacy one): nothing to allow
    flt.add_rule(seccomp.ALLOW, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, CLONE_NEW, 0))
    # clone3's flags are in memory, out of a filter's reach: ENOSYS, and glibc falls back to clone()
    flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for family in SOCKET_FAMILIES.values():
        flt.add_rule(seccomp.ALLOW, "socket", seccomp.Arg(0, seccomp.EQ, family))
    for request in IOCTLS.values():
        flt.add_rule(seccomp.ALLOW, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
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
