"""Runs inside the sandbox (passed as `python3 -I -c <this file>`): set the limits, run the code.

Reads the code from stdin. The last expression's value is written as JSON to the fd named by argv[2] with the
run's own resource use; stdout and stderr are the code's. Only the standard library is used:
this file runs under the system Python, never the project's.
"""

import ast
import json
import os
import resource
import sys
import traceback
import types


def limit(which, value):
    resource.setrlimit(which, (value, value))  # hard = soft: the code cannot raise them


def main():
    limits = json.loads(sys.argv[1])
    limit(resource.RLIMIT_CPU, limits["cpu_s"])
    limit(resource.RLIMIT_AS, limits["memory_mb"] << 20)
    limit(resource.RLIMIT_NPROC, limits["processes"])
    limit(resource.RLIMIT_NOFILE, limits["open_files"])
    limit(resource.RLIMIT_FSIZE, limits["file_bytes"])
    limit(resource.RLIMIT_CORE, 0)
    report = os.fdopen(int(sys.argv[2]), "w")
    os.set_inheritable(report.fileno(), False)
    me = os.getpid()
    code = sys.stdin.read()
    value, error = None, None
    with open(os.devnull) as sys.stdin:  # the code's stdin: empty (its code was read)
        try:
            tree = ast.parse(code, "<code>")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            main_module = types.ModuleType("__main__")  # the code's module: functions it defines pickle
            sys.modules["__main__"] = main_module  # by name, so multiprocessing's workers find them
            scope = main_module.__dict__
            exec(compile(tree, "<code>", "exec"), scope)  # noqa: S102 - running it is the point
            if last is not None:
                result = eval(compile(ast.Expression(last.value), "<code>", "eval"), scope)
                if result is not None:
                    value = repr(result)[: limits["value_chars"]]
        except BaseException as exc:  # noqa: BLE001 - the code's own failure is its output
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            frames = exc.__traceback__  # from the code's first frame on: this runner's are not the code's
            while frames is not None and frames.tb_frame.f_code.co_filename != "<code>":
                frames = frames.tb_next
            traceback.print_exception(type(exc), exc, frames)
    sys.stdout.flush()
    if os.getpid() != me:  # a child the code forked: only the runner itself reports
        os._exit(1)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    json.dump(
        {
            "value": value,
            "error": error,
            "cpu_s": usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime,
            "max_rss_kb": max(usage.ru_maxrss, children.ru_maxrss),
        },
        report,
    )
    report.close()
    os._exit(1 if error else 0)


main()
