"""`ft serve --data-parallel N`: N engine processes behind one HTTP front (docs/adr/0005-data-parallel.md)."""
