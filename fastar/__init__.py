"""fastar: DeepSeek-V4-Flash on one machine, experts paged from SSD, exact to the reference math."""
__version__ = "0.1.0"
