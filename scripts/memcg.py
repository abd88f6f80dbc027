"""A memory cgroup with a limit, v1 (the memory controller) or v2, whichever is mounted,
and dropping the page cache: what the memory-limited benchmarks (bench-views.py,
bench-moe.py) run their clients in. Needs root."""
import os
import subprocess


class Cgroup:
    def __init__(self, name, limit):
        v1 = "/sys/fs/cgroup/memory"
        base = v1 if os.path.isdir(v1) else "/sys/fs/cgroup"
        self.kind = "v1" if base == v1 else "v2"
        self.dir = os.path.join(base, name)
        os.makedirs(self.dir, exist_ok=True)
        knob = "memory.limit_in_bytes" if self.kind == "v1" else "memory.max"
        with open(os.path.join(self.dir, knob), "w") as f:
            f.write(str(limit))

    def enter_cmd(self, argv):
        """argv run by a shell that first moves itself into the cgroup (its children,
        a daemon among them, stay there)."""
        procs = os.path.join(self.dir, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def close(self):
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def drop_caches():
    subprocess.run(["sync"])
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
