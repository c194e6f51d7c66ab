"""Where a benchmark figure came from: kvstore.provenance, which the fleet simulator's commands record
their runs with too. Here for the benchmarks run as scripts (benchmarks/ is sys.path[0]):

    if __name__ == "__main__":
        from provenance import recorded

        recorded(main)
"""

from kvstore.provenance import commit, machine, record, recorded, runs_dir

__all__ = ["commit", "machine", "record", "recorded", "runs_dir"]
