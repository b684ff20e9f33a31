"""Byte units for printed figures."""


def memory_unit(nbytes: float) -> tuple[str, float]:
    """("KiB"|"MiB"|"GiB", bytes per unit) to print `nbytes`-sized figures readably."""
    if nbytes >= 2**30:
        return "GiB", 2.0**30
    if nbytes >= 2**20:
        return "MiB", 2.0**20
    return "KiB", 2.0**10
