// Where downloads are kept between builds: $FORKLING_CACHE, else the store's
// cache directory. Tests point FORKLING_HOME at a fresh store and FORKLING_CACHE
// at a persistent one so they do not download everything each run.
import { storePath } from '../host/store.ts';

export const cacheRoot = (): string => process.env.FORKLING_CACHE || storePath('cache');
