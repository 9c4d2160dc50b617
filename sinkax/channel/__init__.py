"""The data channel: dataset -> source -> producer thread -> ring of device-resident chunks."""
