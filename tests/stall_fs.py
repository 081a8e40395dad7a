"""A directory that stops answering on demand, for tests of a server whose disk tier blocks
(issue 60 part 3): a FUSE file system that passes every call through to BACKING, except that
while the file STALL exists every call that touches a file's data or the tree blocks until it is
gone, as a hung disk or a dead network volume does.

usage: stall_fs.py BACKING MOUNTPOINT STALL
Runs in the foreground until unmounted (umount MOUNTPOINT). Prints "mounted" once the mount is
up; exits 77 with "SKIP: ..." where FUSE is not available (no fusepy, no /dev/fuse, mount refused).
"""
import errno
import os
import sys
import threading
import time

try:
    from fusepy import FUSE, FuseOSError, Operations
except ImportError:  # the name of the module before Debian 12's python3-fusepy 3.0
    try:
        from fuse import FUSE, FuseOSError, Operations
    except ImportError:
        print("SKIP: no fusepy (apt-get install python3-fusepy)", flush=True)
        sys.exit(77)


class StallFS(Operations):
    def __init__(self, backing: str, stall: str) -> None:
        self.backing = backing
        self.stall = stall
        self.stalled_calls = 0
        self.count_lock = threading.Lock()  # not `lock`: fusepy's name for the POSIX lock call

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _wait(self) -> None:
        counted = False
        while os.path.exists(self.stall):
            if not counted:
                with self.count_lock:
                    self.stalled_calls += 1
                print(f"stalled call {self.stalled_calls}", flush=True)
                counted = True
            time.sleep(0.02)

    def __call__(self, op, *args):
        try:
            return super().__call__(op, *args)
        except OSError as e:
            raise FuseOSError(e.errno or errno.EIO)

    # The tree.
    def getattr(self, path, fh=None):
        st = os.lstat(self._path(path))
        return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size",
                                            "st_atime", "st_mtime", "st_ctime")}

    def access(self, path, mode):
        if not os.access(self._path(path), mode):
            raise FuseOSError(errno.EACCES)

    def readdir(self, path, fh):
        return [".", ".."] + os.listdir(self._path(path))

    def mkdir(self, path, mode):
        self._wait()
        os.mkdir(self._path(path), mode)

    def rmdir(self, path):
        self._wait()
        os.rmdir(self._path(path))

    def unlink(self, path):
        self._wait()
        os.unlink(self._path(path))

    def rename(self, old, new):
        self._wait()
        os.rename(self._path(old), self._path(new))

    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)

    def chown(self, path, uid, gid):
        os.chown(self._path(path), uid, gid)

    def utimens(self, path, times=None):
        os.utime(self._path(path), times)

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        return {k: getattr(st, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize",
                                            "f_favail", "f_ffree", "f_files", "f_flag",
                                            "f_frsize", "f_namemax")}

    # The data.
    def create(self, path, mode, fi=None):
        self._wait()
        # Read and write whatever the caller asked: fusepy hands no flags without raw_fi.
        return os.open(self._path(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

    def open(self, path, flags):
        self._wait()
        return os.open(self._path(path), flags & ~os.O_DIRECT)

    def read(self, path, size, offset, fh):
        self._wait()
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self._wait()
        return os.pwrite(fh, data, offset)

    def truncate(self, path, length, fh=None):
        self._wait()
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._path(path), length)

    def fallocate(self, path, mode, offset, length, fh):
        self._wait()
        os.posix_fallocate(fh, offset, length)

    def flush(self, path, fh):
        return 0

    def fsync(self, path, datasync, fh):
        self._wait()
        os.fsync(fh)

    def release(self, path, fh):
        os.close(fh)


def main() -> int:
    backing, mountpoint, stall = sys.argv[1:4]
    if not os.path.exists("/dev/fuse"):
        print("SKIP: no /dev/fuse", flush=True)
        return 77

    def announce() -> None:
        for _ in range(200):
            if os.path.ismount(mountpoint):
                print("mounted", flush=True)
                return
            time.sleep(0.05)

    threading.Thread(target=announce, daemon=True).start()
    try:
        FUSE(StallFS(os.path.abspath(backing), stall), mountpoint, foreground=True,
             nothreads=False, allow_other=True)
    except RuntimeError as e:
        print(f"SKIP: FUSE mount refused: {e}", flush=True)
        return 77
    return 0


if __name__ == "__main__":
    sys.exit(main())
