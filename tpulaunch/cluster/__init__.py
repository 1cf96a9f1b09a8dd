"""Ray clusters: start an emulated slice here (`emulated`), bring one up on a real slice over
gcloud ssh or join it from a TPU VM (`remote`), find and connect to one (`connect`), and the record
`cluster up` leaves for `--address auto` (`record`)."""
