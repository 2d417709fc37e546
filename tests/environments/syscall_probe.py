"""The start of a sandbox program that makes raw system calls (shared by the seccomp tests).

:data:`HELPER` defines ``call(name, *args) -> [return value, errno]`` over the table ``nr``,
which the test puts in place of ``NUMBERS`` (``{name: syscall number}`` of this machine)."""

HELPER = """
import ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
nr = NUMBERS
def call(name, *args):
    ctypes.set_errno(0)
    rc = libc.syscall(nr[name], *args)
    return [rc, ctypes.get_errno()]
"""
