"""Online learning off the serving path: the shadow scorer that scores sampled live traffic
against the clean model, and the estimators that refit T* and the bias and publish new policies."""
