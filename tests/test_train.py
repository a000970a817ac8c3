"""Pieces of the demo's training (train/) that decide what the model sees."""

import random

import numpy as np

from train.data import rename_identifiers
from train.train import copy_weights


def test_copy_weights_mark_repeats_of_rare_tokens_only():
    x = np.array([[5, 7, 9, 7, 5, 9, 3], [1, 1, 1, 2, 3, 2, 2]])
    common = np.zeros(10, bool)
    common[[5, 1]] = True
    w = copy_weights(x, common, 3.0)
    # targets: 7 9 7* 5(common) 9* 3 / 1(common) 1(common) 2 3 2* 2*
    assert w.tolist() == [[1, 1, 4, 1, 4, 1], [1, 1, 1, 1, 4, 4]]


def test_renamed_identifiers_are_consistent_and_keep_the_rest():
    src = ("def total(items, start=0):\n    acc = start\n    for item in items:\n"
           "        acc += len(item)  # count\n    return acc.real\n")
    # few words: new names often coincide unless the renamer prevents it
    new = rename_identifiers(src, random.Random(0), ["alpha", "beta", "gamma", "delta"])
    compile(new, "<renamed>", "exec")
    for kept in ("def ", "for ", " in ", "len(", "return ", ".real", "# count", "=0"):
        assert kept in new
    for old in ("total", "items", "start", "acc", "item"):
        assert old not in new.replace("# count", "")
    first_line = new.split("\n")[0]
    name = first_line.split()[1].split("(")[0]
    ns = {}
    exec(new, ns)
    assert ns[name](["ab", "c"], 1) == 4
