"""Write the shipped tile tables of GPU families nobody has timed yet from the sm90 table
(`tile_tables.derive`): Jetson Orin (sm87: no programmatic dependent launches) and Thor (sm110: with them). `jetserve tune --out` on such a device replaces its table with
measured choices. Run from the repository root: python3 tools/derive_tile_tables.py"""

from jetserve.engine.model import tile_tables

FAMILIES = {"sm87": False, "sm110": True}  # name: programmatic dependent launches

source = tile_tables.TileTable.read(tile_tables.TABLES / "sm90.json")
for name, pdl in FAMILIES.items():
    note = (f"derived from sm90 by tile_tables.derive (pdl={pdl}) in tools/derive_tile_tables.py; "
            "not timed on the family: `jetserve tune --out` on a device measures it")
    table = tile_tables.derive(source, name, pdl, note)
    (tile_tables.TABLES / f"{name}.json").write_text(table.to_json())
    print(f"{name}: {len(table.shapes)} shapes")
