"""The sandbox runner's private filesystem: loaded by ``_sandbox_child.py`` from its own folder (by path, before
any test runs), never imported by vlrl. Standard library only.

In a mount namespace (as root there) `private_filesystem` switches the runner to a new root that holds only what
a program needs — the interpreter, its standard library, its shared libraries and the allow-listed packages, all
read-only — with a fresh size-limited tmpfs on every writable place; the host's root is unmounted after the switch.
"""

import ctypes
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18, 2)
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
_KEPT_FLAGS = MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME  # a remount must keep these (user namespaces)
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                   data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def private_filesystem(job: dict) -> str | None:
    """Replace the filesystem this process sees by a new read-only root holding only what a program needs; None on
    success, else what failed (the caller then runs nothing).

    The new root is a tmpfs with read-only bind mounts of: the interpreter (its executable and the symlinks
    leading to it, ``pyvenv.cfg``), the standard library (its ``site-packages`` hidden), the shared libraries
    the interpreter has loaded (a system library directory whole, elsewhere the loaded files and their sibling
    ``.so`` files), ``/etc/ld.so.cache``, the packages ``job["packages"]`` allow-lists, and ``/dev/null``,
    ``zero``, ``full``, ``random``, ``urandom``. Every writable place is a fresh, size-limited tmpfs: ``/tmp``
    (``disk_bytes``; the working directory ``/tmp/work``), ``/var/tmp``, ``/dev/shm``, ``/run/lock``,
    ``/run/user`` and every other world-writable (or ``nobody``-writable) mount point found in
    ``/proc/self/mountinfo``. ``/proc`` is this PID namespace's. Then the root is switched (``pivot_root``)
    and the host's root unmounted: no other host file is reachable, whatever its permissions.
    """
    try:
        writable = sorted(set(_STANDARD_WRITABLE) | set(_writable_mounts()))
        binds = _needed_paths(job.get("packages", []))
        links = [link for path in binds for link in _symlink_chain(path)[0]]
        real = [(_symlink_chain(path)[1], kind) for path, kind in binds.items()]
        _mount("none", "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mount table
        _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")  # the new root
        os.mkdir("/tmp/.old")
        _pivot_root("/tmp", "/tmp/.old")
        os.chdir("/")
        for path in writable:  # first: an interpreter under /tmp is bound into the private /tmp below
            _writable_tmpfs(path, job["disk_bytes"] if path == "/tmp" else 1 << 20)
        for link, target in links:
            _makedirs(os.path.dirname(link))
            if not os.path.lexists(link):
                os.symlink(target, link)
        _bind_all(real, old="/.old")
        for name in ("fd", "stdin", "stdout", "stderr"):
            target = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
                      "stderr": "/proc/self/fd/2"}[name]
            if not os.path.lexists(f"/dev/{name}"):
                os.symlink(target, f"/dev/{name}")
        _makedirs("/proc")
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes only
        if _libc.umount2(b"/.old", MNT_DETACH) != 0:
            raise OSError(ctypes.get_errno(), "umount the old root")
        os.rmdir("/.old")
        _mount("none", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    except OSError as err:
        return f"{type(err).__name__}: {err}"
    os.mkdir("/tmp/work", 0o755)  # the runner's: each test gets a directory of its own below it (`_sandbox_child._test_directory`)
    os.chmod("/tmp/work", 0o755)
    os.chdir("/tmp/work")
    return None


_STANDARD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/run/user")
_PSEUDO_FS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs", "pstore",
              "bpf", "configfs", "fusectl", "binfmt_misc", "autofs", "efivarfs", "nsfs", "rpc_pipefs"}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203, "s390x": 217,
               "i686": 217, "i386": 217, "armv7l": 218, "armv6l": 218, "loongarch64": 41}


def _writable_mounts() -> list[str]:
    """Mount points of this machine that a user without privileges could write to (world-writable, or owned by
    ``nobody``), pseudo filesystems (/proc, /sys, cgroups, ...) aside: each gets a private tmpfs."""
    out = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            try:
                point = fields[4].encode().decode("unicode_escape")  # \040 → space
                fstype = fields[fields.index("-") + 1]
            except (IndexError, ValueError):
                continue
            if fstype in _PSEUDO_FS or point.startswith(("/proc", "/sys")):
                continue
            try:
                st = os.stat(point)
            except OSError:
                continue
            if os.path.isdir(point) and (st.st_mode & 0o002 or st.st_uid == 65534):
                out.append(point)
    return out


def _needed_paths(packages: list) -> dict[str, str]:
    """Host paths the new root shows, read-only: path → ``bind`` (the file or directory) or ``hide`` (an empty
    read-only directory over it, e.g. the standard library's own ``site-packages``)."""
    import importlib.util
    import sysconfig

    paths: dict[str, str] = {}
    stdlib = {os.path.realpath(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib")}
    for path in stdlib:
        paths[path] = "bind"
        for sub in ("site-packages", "dist-packages"):
            if os.path.isdir(os.path.join(path, sub)):
                paths[os.path.join(path, sub)] = "hide"
    for path in sys.path:
        if path.endswith(".zip") and os.path.isfile(path):
            paths[path] = "bind"
    paths[sys.executable] = "bind"
    for cfg in (os.path.join(sys.prefix, "pyvenv.cfg"), "/etc/ld.so.cache"):
        if os.path.isfile(cfg):
            paths[cfg] = "bind"
    for path in _loaded_libraries():
        if any(path.startswith(lib + os.sep) for lib in stdlib):
            continue
        folder = os.path.dirname(path)
        if folder.startswith(("/usr/lib", "/lib", "/usr/local/lib")):  # a system library directory: whole
            paths[folder] = "bind"
        else:  # e.g. libpython next to the interpreter: the loaded file and its sibling shared objects
            for name in os.listdir(folder):
                if name.endswith(".so") or ".so." in name:
                    paths[os.path.join(folder, name)] = "bind"
    interp = _elf_interpreter(os.path.realpath(sys.executable))
    if interp:
        paths[interp] = "bind"
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin and not spec.submodule_search_locations:
            raise OSError(2, f"allow-listed package {name!r} is not installed")
        where = list(spec.submodule_search_locations or []) or [spec.origin]
        for path in where:
            paths[path] = "bind"
            libs = os.path.join(os.path.dirname(path), f"{name}.libs")  # auditwheel's vendored libraries
            if os.path.isdir(libs):
                paths[libs] = "bind"
    for device in _DEVICES:
        if os.path.exists(f"/dev/{device}"):
            paths[f"/dev/{device}"] = "device"
    return paths


def _loaded_libraries() -> list[str]:
    out = set()
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/") and not fields[5].endswith(" (deleted)\n"):
                out.add(os.path.realpath(fields[5].strip()))
    return sorted(p for p in out if os.path.isfile(p))


def _elf_interpreter(path: str) -> str | None:
    """The program interpreter (``PT_INTERP``, e.g. /lib64/ld-linux-x86-64.so.2) of a 64- or 32-bit ELF file."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if head[:4] != b"\x7fELF":
                return None
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide:
                phoff, = struct.unpack_from(order + "Q", head, 32)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 54)
            else:
                phoff, = struct.unpack_from(order + "I", head, 28)
                phentsize, phnum = struct.unpack_from(order + "HH", head, 42)
            for k in range(min(phnum, 64)):
                f.seek(phoff + k * phentsize)
                entry = f.read(phentsize)
                if struct.unpack_from(order + "I", entry, 0)[0] != 3:  # PT_INTERP
                    continue
                offset, size = (struct.unpack_from(order + "QQQQ", entry, 8)[0], struct.unpack_from(order + "Q", entry, 32)[0]) \
                    if wide else (struct.unpack_from(order + "I", entry, 4)[0], struct.unpack_from(order + "I", entry, 16)[0])
                f.seek(offset)
                return f.read(min(size, 4096)).rstrip(b"\0").decode() or None
    except (OSError, struct.error, UnicodeDecodeError):
        return None
    return None


def _symlink_chain(path: str) -> tuple[list[tuple[str, str]], str]:
    """(every symlink met while resolving ``path`` as (link, target), the real path) — so the new root can
    repeat the links (``/lib64 → usr/lib64``, a virtualenv's ``bin/python → /usr/bin/python3``)."""
    links: list[tuple[str, str]] = []
    parts, resolved, hops = [p for p in path.split("/") if p], "/", 0
    while parts:
        name = parts.pop(0)
        if name == ".":
            continue
        if name == "..":
            resolved = os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, name)
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                raise OSError(40, f"too many symbolic links resolving {path}")
            target = os.readlink(candidate)
            links.append((candidate, target))
            parts = [p for p in target.split("/") if p] + parts
            if target.startswith("/"):
                resolved = "/"
        else:
            resolved = candidate
    return links, resolved


def _bind_all(paths: list[tuple[str, str]], *, old: str) -> None:
    """Bind each host path (seen under ``old``) at its own place in the new root: read-only, no set-uid, no
    devices (but the device nodes). Parents first; a path already shown through a bound parent is skipped,
    except an allow-listed package inside a hidden directory."""
    order = {"bind": 0, "device": 0, "hide": 1}
    done: list[str] = []
    for path, kind in sorted(set(paths), key=lambda item: (order[item[1]], item[0])):
        if kind != "hide" and any(path == d or path.startswith(d.rstrip("/") + "/") for d in done):
            continue
        if kind == "hide":
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
            continue
        source = old + path
        if os.path.isdir(source):
            _makedirs(path)
        else:
            _makedirs(os.path.dirname(path))
            if not os.path.exists(path):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
        _mount(source, path, None, MS_BIND)  # not MS_REC: mounts below it (a writable one) are not carried in
        flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if kind == "device" else MS_RDONLY | MS_NODEV)
        _mount("none", path, None, flags | (os.statvfs(path).f_flag & _KEPT_FLAGS))
        done.append(path)
    for path, kind in paths:  # allow-listed packages under a hidden directory (base site-packages)
        if kind == "bind" and not os.path.exists(path) and os.path.exists(old + path):
            _makedirs(path if os.path.isdir(old + path) else os.path.dirname(path))
            if not os.path.isdir(old + path):
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
            _mount(old + path, path, None, MS_BIND)
            _mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
                   | (os.statvfs(path).f_flag & _KEPT_FLAGS))
    for path, kind in paths:
        if kind == "hide":
            _mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _writable_tmpfs(path: str, size: int) -> None:
    try:
        _makedirs(path)
    except OSError:  # inside a read-only bound directory: nothing there is writable anyway
        return
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")


def _makedirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _pivot_root(new_root: str, put_old: str) -> None:
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(38, f"pivot_root: unknown system call number on {os.uname().machine}")
    if _libc.syscall(number, new_root.encode(), put_old.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
