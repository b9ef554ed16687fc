"""What holds a staged step directory: its directory handle (`held`), its one writer (`lock`), and a
trainer's pin against retention (`pin`)."""
