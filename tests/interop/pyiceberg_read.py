"""Read SignalWeave tables with PyIceberg through the same SQL catalog.

Usage: pyiceberg_read.py CATALOG_URI WAREHOUSE [S3 options as key=value ...]
Prints one JSON object: row count and amount sum of signalweave.events, and the row
count of signalweave.rejections.
"""
import json
import sys

import pyarrow.compute as pc
from pyiceberg.catalog.sql import SqlCatalog


def main() -> None:
    uri, warehouse, *extra = sys.argv[1:]
    props = {"uri": uri, "warehouse": warehouse}
    props.update(kv.split("=", 1) for kv in extra)
    catalog = SqlCatalog("signalweave", **props)
    events = catalog.load_table("signalweave.events").scan().to_arrow()
    rejections = catalog.load_table("signalweave.rejections").scan().to_arrow()
    print(
        json.dumps(
            {
                "events": events.num_rows,
                "amount_minor_sum": pc.sum(events["amount_minor"]).as_py() or 0,
                "distinct_event_ids": len(pc.unique(events["event_id"])),
                "rejections": rejections.num_rows,
            }
        )
    )


if __name__ == "__main__":
    main()
