"""Event vocabulary, Avro schemas of every released version, codec and upcasters.

Import the modules themselves (``runlog.schemas.models``, ``runlog.schemas.codec``): this
file loads nothing, so the pure fold can use the models without loading fastavro.
"""
