"""Event vocabulary, Avro schemas of every released version, codec and upcasters.

Import the modules themselves (``runlog.schemas._models``, ``runlog.schemas._codec``): this
file loads nothing, so the pure fold can use the models without loading fastavro.
"""
