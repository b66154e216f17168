"""eagle3data: token-exact EAGLE-3 drafter training data.

Stages (notebooks under `notebooks/`, headless via `python -m eagle3data run`):
01 generate -> 02 reconstruct -> 03 audit -> 04 extract hidden states.
"""

from eagle3data.core.params import RunParams, load_params
from eagle3data.core.profiles import PROFILES, Profile, get_profile
from eagle3data.core.records import Journal, Record, read_records

__all__ = ["RunParams", "load_params", "Profile", "PROFILES", "get_profile", "Record", "Journal", "read_records"]
__version__ = "0.1.0"
