"""offload.native against the C header and the library (run by CTest as `python_abi_test`; needs
no torch): the ctypes mirror has every struct of optimizer_client/capi/offload_c.h with its
fields in the header's order, the library's own layout table agrees, and the check at load
refuses a mirror that differs, naming the struct and the field. The bucket planner of the ABI
groups greedily as its contract says, and a library without this package's functions is refused.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import os
import random
import re
import subprocess
import sys
import unittest
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from offload import native  # noqa: E402
from offload.native import OffloadError  # noqa: E402

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "optimizer_client",
                      "capi", "offload_c.h")


def header_structs() -> Dict[str, List[str]]:
    """Each struct typedef of the header (name -> field names in declaration order)."""
    with open(HEADER) as f:
        text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
    structs = {}
    for body, name in re.findall(r"typedef\s+struct\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
        fields = []
        for declaration in body.split(";"):
            words = re.findall(r"\w+", declaration)
            if words:
                fields.append(words[-1])
        structs[name] = fields
    return structs


def greedy(sizes: List[int], bucket_elements: int) -> List[int]:
    """The contract of offload_plan_buckets, written out."""
    out, bucket, held = [], 0, 0
    for n in sizes:
        out.append(bucket)
        held += n
        if held >= bucket_elements:
            bucket, held = bucket + 1, 0
    return out


class Mirror(unittest.TestCase):

    def test_every_struct_of_the_header_is_mirrored_field_by_field(self) -> None:
        structs = header_structs()
        mirrors = {m.__name__: m for m in native.MIRRORS}
        self.assertIn("OffloadConfig", structs)
        self.assertEqual(sorted(structs), sorted(mirrors))
        for name, fields in structs.items():
            self.assertEqual([f for f, _ in mirrors[name]._fields_], fields, name)

    def test_the_library_reports_the_headers_fields(self) -> None:
        table = native.read_layout(native.lib())
        structs = header_structs()
        self.assertEqual(list(table), list(structs))  # in declaration order
        for name, rows in table.items():
            self.assertEqual(rows[0], (None, 0, ctypes.sizeof(getattr(native, name))), name)
            self.assertEqual([f for f, _, _ in rows[1:]], structs[name], name)
        native.check_layout(table)  # what lib() ran at load

    def test_a_mirror_that_differs_is_refused_naming_the_struct_and_field(self) -> None:
        table = native.read_layout(native.lib())
        u64 = ctypes.c_uint64

        def refused(mirror: type, *words: str) -> None:
            with self.assertRaises(OffloadError) as e:
                native.check_layout(table, [mirror])
            self.assertEqual(e.exception.code, 9)
            for w in words:
                self.assertIn(w, str(e.exception))

        # A field moved: the first place that differs is named.
        moved = type("OffloadRangeStep", (ctypes.Structure,),
                     {"_fields_": [("length", u64), ("offset", u64), ("t", u64)]})
        refused(moved, "OffloadRangeStep", "field 0", "offset", "length")
        # A field of another size, which moves the one after it too.
        narrow = type("OffloadRangeStep", (ctypes.Structure,),
                      {"_fields_": [("offset", ctypes.c_uint32), ("length", u64), ("t", u64)]})
        refused(narrow, "OffloadRangeStep.offset", "size 8", "size 4")
        # One missing, one too many.
        short = type("OffloadRangeStep", (ctypes.Structure,),
                     {"_fields_": [("offset", u64), ("length", u64)]})
        refused(short, "OffloadRangeStep.t", "not in this package")
        extra = type("OffloadRangeStep", (ctypes.Structure,),
                     {"_fields_": [("offset", u64), ("length", u64), ("t", u64), ("x", u64)]})
        refused(extra, "OffloadRangeStep.x", "not in the library")
        # A struct the library does not have.
        unknown = type("OffloadNoSuchStruct", (ctypes.Structure,), {"_fields_": [("a", u64)]})
        refused(unknown, "OffloadNoSuchStruct")
        # The library's struct of another size (a stale library), the fields alike.
        stale = copy.deepcopy(table)
        stale["OffloadRangeStep"][0] = (None, 0, 32)
        with self.assertRaisesRegex(OffloadError, "OffloadRangeStep is 32 bytes in the library, "
                                                  "24 here"):
            native.check_layout(stale, [native.OffloadRangeStep])

    def test_a_library_without_this_packages_functions_is_refused_at_load(self) -> None:
        libc = ctypes.util.find_library("c")
        run = subprocess.run(
            [sys.executable, "-c", "import offload.native as n; n.lib()"],
            env=dict(os.environ, OFFLOAD_LIBRARY=libc), capture_output=True, text=True)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("FAILED_PRECONDITION", run.stderr)
        self.assertIn("older than this package", run.stderr)


class PlanBuckets(unittest.TestCase):

    def test_the_greedy_rule(self) -> None:
        self.assertEqual(native.plan_buckets([3, 4, 5, 2, 6, 1], 6), [0, 0, 1, 1, 2, 3])
        self.assertEqual(native.plan_buckets([], 6), [])
        rng = random.Random(0)
        for _ in range(200):
            sizes = [rng.choice([0, 1, 7, 64, 1000, 4096]) for _ in range(rng.randint(1, 40))]
            for bucket_elements in (1, 2, 100, 4096, 5000, 1 << 22, (1 << 64) - 1):
                self.assertEqual(native.plan_buckets(sizes, bucket_elements),
                                 greedy(sizes, bucket_elements), (sizes, bucket_elements))

    def test_refusals(self) -> None:
        with self.assertRaises(OffloadError) as e:
            native.plan_buckets([1, 2], 0)
        self.assertEqual(e.exception.code, 3)
        self.assertIn("bucket_elements is 0", str(e.exception))  # offload_last_error()
        with self.assertRaises(OffloadError) as e:
            native.plan_buckets([(1 << 63) - 1, 1], 4)
        self.assertEqual(e.exception.code, 3)


if __name__ == "__main__":
    unittest.main()
