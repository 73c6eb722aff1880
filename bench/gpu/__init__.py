"""The GPU benchmark: pack (here), build and measure (on the device machine); see run.sh."""
