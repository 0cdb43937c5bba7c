"""The streaming engines. ``linear.LinearEngine`` is the linear route; ``slabs`` holds the host side."""
